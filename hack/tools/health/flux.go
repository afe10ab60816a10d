package main

import (
	"context"
	"fmt"
	"os"

	"github.com/google/cel-go/cel"
	"github.com/google/cel-go/common/types"
	"github.com/google/cel-go/ext"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"sigs.k8s.io/yaml"
)

// A Flux Kustomization's spec.healthCheckExprs entry.
type fluxCheck struct {
	APIVersion string `json:"apiVersion"`
	Kind       string `json:"kind"`
	Current    string `json:"current"`
	InProgress string `json:"inProgress,omitempty"`
	Failed     string `json:"failed,omitempty"`
}

// loadFluxChecks reads a list of healthCheckExprs entries (the YAML a user pastes under
// spec.healthCheckExprs).
func loadFluxChecks(path string) ([]fluxCheck, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var checks []fluxCheck
	if err := yaml.UnmarshalStrict(raw, &checks); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return checks, nil
}

// fluxHealth evaluates the entry for obj's apiVersion and kind as Flux does
// (fluxcd/pkg runtime/cel StatusEvaluator, RFC 0009): a status.observedGeneration that
// differs from metadata.generation is InProgress without evaluating anything; then
// inProgress, failed, current in that order, the first true one wins; none true is
// InProgress. An expression that does not parse is an error (Flux rejects the
// Kustomization); one that fails to evaluate (a field the object does not have yet) makes
// the status Unknown, as cli-utils' generic status reader reports a StatusFunc error.
func fluxHealth(checks []fluxCheck, obj map[string]any) (Result, error) {
	u := unstructured.Unstructured{Object: obj}
	var check *fluxCheck
	for i := range checks {
		if checks[i].APIVersion == u.GetAPIVersion() && checks[i].Kind == u.GetKind() {
			check = &checks[i]
			break
		}
	}
	if check == nil {
		return Result{}, fmt.Errorf("no healthCheckExprs entry for %s %s", u.GetAPIVersion(), u.GetKind())
	}
	if check.Current == "" {
		return Result{}, fmt.Errorf("healthCheckExprs entry for %s has no current expression", check.Kind)
	}
	observed, found, err := unstructured.NestedInt64(obj, "status", "observedGeneration")
	if err != nil {
		return Result{}, err
	}
	if found {
		gen, ok, err := unstructured.NestedInt64(obj, "metadata", "generation")
		if err != nil {
			return Result{}, err
		}
		if ok && gen != observed {
			return Result{Status: "InProgress", Message: "status.observedGeneration differs from metadata.generation"}, nil
		}
	}
	exprs := []struct{ name, expr, status string }{
		{"inProgress", check.InProgress, "InProgress"},
		{"failed", check.Failed, "Failed"},
		{"current", check.Current, "Current"},
	}
	progs := make([]cel.Program, len(exprs))
	for i, e := range exprs {
		if e.expr == "" {
			continue
		}
		if progs[i], err = parse(e.expr); err != nil {
			return Result{}, fmt.Errorf("%s: %w", e.name, err)
		}
	}
	for i, e := range exprs {
		if progs[i] == nil {
			continue
		}
		ok, err := evalBool(progs[i], e.expr, obj)
		if err != nil {
			return Result{Status: "Unknown", Message: e.name + ": " + err.Error()}, nil
		}
		if ok {
			return Result{Status: e.status, Message: e.name + " is true"}, nil
		}
	}
	return Result{Status: "InProgress", Message: "no expression is true"}, nil
}

// parse parses (not compiles: CRDs need not have the five standard top-level fields) one
// expression in the environment fluxcd/pkg's runtime/cel NewExpression builds.
func parse(expr string) (cel.Program, error) {
	env, err := cel.NewEnv(
		cel.HomogeneousAggregateLiterals(),
		cel.EagerlyValidateDeclarations(true),
		cel.DefaultUTCTimeZone(true),
		cel.CrossTypeNumericComparisons(true),
		cel.OptionalTypes(),
		ext.Strings(),
		ext.Sets(),
		ext.Encoders(),
	)
	if err != nil {
		return nil, err
	}
	ast, issues := env.Parse(expr)
	if issues != nil && issues.Err() != nil {
		return nil, fmt.Errorf("parsing %q: %s", expr, issues.String())
	}
	return env.Program(ast, cel.EvalOptions(cel.OptOptimize), cel.InterruptCheckFrequency(100))
}

// evalBool runs one parsed expression; the object's top-level fields are the variables.
func evalBool(prog cel.Program, expr string, obj map[string]any) (bool, error) {
	val, _, err := prog.ContextEval(context.Background(), obj)
	if err != nil {
		return false, fmt.Errorf("evaluating %q: %w", expr, err)
	}
	b, ok := val.(types.Bool)
	if !ok {
		return false, fmt.Errorf("%q is not a boolean", expr)
	}
	return bool(b), nil
}

// Command health evaluates an SFTJob the way GitOps tools do: Argo CD's Lua health check
// (in gopher-lua, set up as Argo CD sets it up), kstatus (the library Flux and kubectl use)
// and Flux's healthCheckExprs (CEL). The tests run it on objects the operator wrote, so
// the mapping documented in integrations/ is checked against the real tools' code.
//
//	health argo HEALTH_LUA OBJECT...          Argo CD health of each object
//	health argo-test DIR                      run DIR/health_test.yaml against DIR/health.lua
//	health kstatus OBJECT...                  kstatus.Compute of each object
//	health flux EXPRS_YAML OBJECT...          Flux healthCheckExprs of each object
//	health all HEALTH_LUA EXPRS_YAML OBJECT...  the three at once
//
// OBJECT is a YAML or JSON file, or - for standard input (one object, e.g. kubectl get -o json).
// Each result is one JSON line; a failed evaluation exits 1 and says why on stderr.
package main

import (
	"encoding/json"
	"fmt"
	"os"
)

const usage = `usage:
  health argo HEALTH_LUA OBJECT...
  health argo-test DIR
  health kstatus OBJECT...
  health flux EXPRS_YAML OBJECT...
  health all HEALTH_LUA EXPRS_YAML OBJECT...`

// Result is what one tool says about one object.
type Result struct {
	Status  string `json:"status"`
	Message string `json:"message"`
}

func main() {
	if err := run(os.Args[1:]); err != nil {
		fmt.Fprintln(os.Stderr, "health:", err)
		os.Exit(1)
	}
}

func run(args []string) error {
	need := map[string]int{"argo": 2, "argo-test": 1, "kstatus": 1, "flux": 2, "all": 3}
	if len(args) == 0 || need[args[0]] == 0 || len(args)-1 < need[args[0]] {
		return fmt.Errorf("%s", usage)
	}
	cmd, rest := args[0], args[1:]
	switch cmd {
	case "argo-test":
		return argoTest(rest[0])
	case "argo":
		script, err := os.ReadFile(rest[0])
		if err != nil {
			return err
		}
		return each(rest[1:], func(path string, obj map[string]any) (any, error) {
			return argoHealth(string(script), obj, false)
		})
	case "kstatus":
		return each(rest, func(path string, obj map[string]any) (any, error) { return kstatus(obj) })
	case "flux":
		checks, err := loadFluxChecks(rest[0])
		if err != nil {
			return err
		}
		return each(rest[1:], func(path string, obj map[string]any) (any, error) { return fluxHealth(checks, obj) })
	default: // all
		script, err := os.ReadFile(rest[0])
		if err != nil {
			return err
		}
		checks, err := loadFluxChecks(rest[1])
		if err != nil {
			return err
		}
		return each(rest[2:], func(path string, obj map[string]any) (any, error) {
			argo, err := argoHealth(string(script), obj, false)
			if err != nil {
				return nil, fmt.Errorf("argo: %w", err)
			}
			ks, err := kstatus(obj)
			if err != nil {
				return nil, fmt.Errorf("kstatus: %w", err)
			}
			flux, err := fluxHealth(checks, obj)
			if err != nil {
				return nil, fmt.Errorf("flux: %w", err)
			}
			return map[string]any{"path": path, "argo": argo, "kstatus": ks, "flux": flux}, nil
		})
	}
}

// each evaluates fn on every object file and prints one JSON line per object.
func each(paths []string, fn func(string, map[string]any) (any, error)) error {
	if len(paths) == 0 {
		return fmt.Errorf("no OBJECT given\n%s", usage)
	}
	for _, path := range paths {
		obj, err := loadObject(path)
		if err != nil {
			return err
		}
		out, err := fn(path, obj)
		if err != nil {
			return fmt.Errorf("%s: %w", path, err)
		}
		line, err := json.Marshal(out)
		if err != nil {
			return err
		}
		fmt.Println(string(line))
	}
	return nil
}

package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	lua "github.com/yuin/gopher-lua"
	luajson "layeh.com/gopher-json"
	"sigs.k8s.io/yaml"
)

// Argo CD's VM setup (util/lua/lua.go, runLuaWithResourceActionParameters and
// ExecuteHealthLua), reproduced step by step so that a script passing here passes there:
// a script from argocd-cm runs without the standard libraries (UseOpenLibs false: no
// string, math or io), a built-in script and Argo CD's own health_test.yaml run with them;
// package, base, table and a two-function os are always there; one second per run.

var validHealth = map[string]bool{
	"Unknown": true, "Progressing": true, "Suspended": true, "Healthy": true, "Degraded": true, "Missing": true,
}

func argoHealth(script string, obj map[string]any, openLibs bool) (Result, error) {
	l := lua.NewState(lua.Options{SkipOpenLibs: !openLibs})
	defer l.Close()
	for _, lib := range []struct {
		name string
		fn   lua.LGFunction
	}{
		{lua.LoadLibName, lua.OpenPackage},
		{lua.BaseLibName, lua.OpenBase},
		{lua.TabLibName, lua.OpenTable},
		{lua.OsLibName, openSafeOs},
	} {
		if err := l.CallByParam(lua.P{Fn: l.NewFunction(lib.fn), NRet: 0, Protect: true}, lua.LString(lib.name)); err != nil {
			return Result{}, err
		}
	}
	l.PreloadModule(lua.OsLibName, openSafeOs)
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	l.SetContext(ctx)
	l.SetGlobal("actionParams", l.CreateTable(0, 0))
	l.SetGlobal("obj", toLua(l, obj))

	fn, err := l.LoadString(script)
	if err == nil {
		l.Push(fn)
		err = l.PCall(0, lua.MultRet, nil)
	}
	if err != nil {
		return Result{}, err
	}
	ret := l.Get(-1)
	switch ret.Type() {
	case lua.LTNil:
		return Result{}, nil
	case lua.LTTable:
	default:
		return Result{}, fmt.Errorf("expect table output from Lua script, not %s", ret.Type())
	}
	raw, err := luajson.Encode(ret)
	if err != nil {
		return Result{}, err
	}
	var hs Result
	if err := json.Unmarshal(raw, &hs); err != nil {
		var typeErr *json.UnmarshalTypeError
		if errors.As(err, &typeErr) && typeErr.Value == "array" { // an empty table encodes as []
			return Result{}, nil
		}
		return Result{}, err
	}
	if !validHealth[hs.Status] {
		return Result{Status: "Unknown", Message: "Lua returned an invalid health status"}, nil
	}
	return hs, nil
}

// toLua converts an object as Argo CD's decodeValue does.
func toLua(l *lua.LState, value any) lua.LValue {
	switch v := value.(type) {
	case bool:
		return lua.LBool(v)
	case float64:
		return lua.LNumber(v)
	case string:
		return lua.LString(v)
	case json.Number:
		return lua.LString(v)
	case int:
		return lua.LNumber(v)
	case int32:
		return lua.LNumber(v)
	case int64:
		return lua.LNumber(v)
	case []any:
		arr := l.CreateTable(len(v), 0)
		for _, item := range v {
			arr.Append(toLua(l, item))
		}
		return arr
	case map[string]any:
		tbl := l.CreateTable(0, len(v))
		for key, item := range v {
			tbl.RawSetH(lua.LString(key), toLua(l, item))
		}
		return tbl
	}
	return lua.LNil
}

// openSafeOs leaves the os module with only time and date, as Argo CD's OpenSafeOs does
// (Argo CD registers its own copies of gopher-lua's two functions; these are the originals).
func openSafeOs(l *lua.LState) int {
	l.Push(l.NewFunction(lua.OpenOs))
	l.Call(0, 1)
	os := l.CheckTable(-1) // also package.loaded.os and the global os: trimmed in place
	var drop []lua.LValue
	os.ForEach(func(k, _ lua.LValue) {
		if name := k.String(); name != "time" && name != "date" {
			drop = append(drop, k)
		}
	})
	for _, k := range drop {
		os.RawSet(k, lua.LNil)
	}
	return 1
}

type healthTests struct {
	Tests []struct {
		InputPath    string `json:"inputPath"`
		HealthStatus Result `json:"healthStatus"`
	} `json:"tests"`
}

// argoTest runs DIR/health_test.yaml as Argo CD's TestLuaHealthScript does, and once more
// without the standard libraries, as the script runs when installed through argocd-cm.
func argoTest(dir string) error {
	script, err := os.ReadFile(filepath.Join(dir, "health.lua"))
	if err != nil {
		return err
	}
	raw, err := os.ReadFile(filepath.Join(dir, "health_test.yaml"))
	if err != nil {
		return err
	}
	var suite healthTests
	if err := yaml.UnmarshalStrict(raw, &suite); err != nil {
		return fmt.Errorf("health_test.yaml: %w", err)
	}
	if len(suite.Tests) == 0 {
		return fmt.Errorf("health_test.yaml has no tests")
	}
	failed := 0
	for _, test := range suite.Tests {
		obj, err := loadObject(filepath.Join(dir, test.InputPath))
		if err != nil {
			return err
		}
		for _, openLibs := range []bool{true, false} {
			mode := map[bool]string{true: "built-in", false: "argocd-cm"}[openLibs]
			got, err := argoHealth(string(script), obj, openLibs)
			switch {
			case err != nil:
				failed++
				fmt.Printf("FAIL %s (%s): %v\n", test.InputPath, mode, err)
			case got != test.HealthStatus:
				failed++
				fmt.Printf("FAIL %s (%s): got %s %q, want %s %q\n", test.InputPath, mode,
					got.Status, got.Message, test.HealthStatus.Status, test.HealthStatus.Message)
			default:
				fmt.Printf("ok   %s (%s): %s %q\n", test.InputPath, mode, got.Status, got.Message)
			}
		}
	}
	if failed > 0 {
		return fmt.Errorf("%d of %d health checks failed", failed, 2*len(suite.Tests))
	}
	return nil
}

package main

import (
	"fmt"
	"io"
	"os"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"sigs.k8s.io/yaml"
)

// loadObject reads one object as the API server's clients hold it: decoded by
// unstructured's JSON decoder, so whole numbers are int64 as in a live object (kstatus
// reads metadata.generation as int64 and fails on a float64).
func loadObject(path string) (map[string]any, error) {
	var data []byte
	var err error
	if path == "-" {
		data, err = io.ReadAll(os.Stdin)
	} else {
		data, err = os.ReadFile(path)
	}
	if err != nil {
		return nil, err
	}
	return decodeObject(data, path)
}

func decodeObject(data []byte, name string) (map[string]any, error) {
	js, err := yaml.YAMLToJSON(data)
	if err != nil {
		return nil, fmt.Errorf("%s: not YAML or JSON: %w", name, err)
	}
	u := &unstructured.Unstructured{}
	if err := u.UnmarshalJSON(js); err != nil {
		return nil, fmt.Errorf("%s: not a Kubernetes object: %w", name, err)
	}
	return u.Object, nil
}

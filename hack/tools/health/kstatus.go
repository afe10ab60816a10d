package main

import (
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"sigs.k8s.io/cli-utils/pkg/kstatus/status"
)

// kstatus is status.Compute, the function kubectl-style waiters and Flux's default health
// check call on any resource.
func kstatus(obj map[string]any) (Result, error) {
	res, err := status.Compute(&unstructured.Unstructured{Object: obj})
	if err != nil {
		return Result{}, err
	}
	return Result{Status: res.Status.String(), Message: res.Message}, nil
}

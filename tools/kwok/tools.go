//go:build tools

// kwok, built from this module (mk/k8s.mk): it simulates nodes and pod lifecycles for the cluster
// tests. Its own module, because kwok's release needs newer client libraries than the control plane's.
package tools

import (
	_ "sigs.k8s.io/kwok/cmd/kwok"
)

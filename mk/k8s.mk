# The real Kubernetes control plane for the operator's cluster tests (tests/k8s): etcd, kube-apiserver,
# kube-controller-manager and kube-scheduler built from Go modules at one release (tools/k8s/go.mod pins
# them; go.sum checks every download). The first build downloads the modules (~750 MB into Go's module
# cache) and compiles for several minutes on two cores; the binaries are kept per machine in
# $(K8S_CACHE), keyed by the pinned module files, and linked into .tools/k8s.
K8S_VERSION ?= v1.35.4
K8S_KEY := $(shell cat tools/k8s/go.mod tools/k8s/go.sum mk/k8s.mk 2>/dev/null | sha256sum | cut -c1-12)
K8S_CACHE ?= $(HOME)/.cache/kvpilot/k8s-$(K8S_VERSION)-$(K8S_KEY)
K8S_BINARIES := etcd kube-apiserver kube-controller-manager kube-scheduler
K8S_LDFLAGS := -s -w \
	-X k8s.io/component-base/version.gitVersion=$(K8S_VERSION) \
	-X k8s.io/component-base/version.gitMajor=1 \
	-X k8s.io/component-base/version.gitMinor=$(word 2,$(subst ., ,$(K8S_VERSION))) \
	-X k8s.io/component-base/version.gitTreeState=clean \
	-X k8s.io/client-go/pkg/version.gitVersion=$(K8S_VERSION)

# kwok simulates nodes and pod lifecycles (its stages: tests/k8s/kwok.yaml). Its own module
# (tools/kwok/go.mod): its release needs newer client libraries than the control plane's, so it is
# built and cached apart, keyed the same way.
KWOK_VERSION ?= v0.8.0
KWOK_KEY := $(shell cat tools/kwok/go.mod tools/kwok/go.sum 2>/dev/null | sha256sum | cut -c1-12)
KWOK_CACHE ?= $(HOME)/.cache/kvpilot/kwok-$(KWOK_VERSION)-$(KWOK_KEY)

.PHONY: k8s-tools test-k8s

k8s-tools: $(TOOLS_DIR)/k8s/.ready $(TOOLS_DIR)/kwok/.ready

test-operator-prereqs: k8s-tools

$(TOOLS_DIR)/k8s/.ready: $(K8S_CACHE)/.built
	mkdir -p $(TOOLS_DIR)
	ln -sfn $(K8S_CACHE) $(TOOLS_DIR)/k8s
	touch $@

# No file prerequisites: the folder is keyed by the content of the pinned files (a fresh clone's newer
# mtimes must not rebuild it).
$(K8S_CACHE)/.built:
	@command -v go >/dev/null || { echo "go is needed to build the Kubernetes control plane (tools/k8s)"; exit 1; }
	@echo "Building etcd and the Kubernetes $(K8S_VERSION) control plane from Go modules into $(K8S_CACHE)"
	@echo "(the first time: ~750 MB of modules downloaded, several minutes of compiling)"
	mkdir -p $(K8S_CACHE).tmp
	cd tools/k8s && go build -trimpath -ldflags "$(K8S_LDFLAGS)" -o $(K8S_CACHE).tmp/ \
		k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
		k8s.io/kubernetes/cmd/kube-scheduler
	cd tools/k8s && go build -trimpath -ldflags "-s -w" -o $(K8S_CACHE).tmp/etcd go.etcd.io/etcd/server/v3
	$(K8S_CACHE).tmp/kube-apiserver --version
	rm -rf $(K8S_CACHE) && mv $(K8S_CACHE).tmp $(K8S_CACHE)
	touch $@

$(TOOLS_DIR)/kwok/.ready: $(KWOK_CACHE)/.built
	mkdir -p $(TOOLS_DIR)
	ln -sfn $(KWOK_CACHE) $(TOOLS_DIR)/kwok
	touch $@

$(KWOK_CACHE)/.built:
	@command -v go >/dev/null || { echo "go is needed to build kwok (tools/kwok)"; exit 1; }
	@echo "Building kwok $(KWOK_VERSION) from Go modules into $(KWOK_CACHE)"
	mkdir -p $(KWOK_CACHE).tmp
	cd tools/kwok && go build -trimpath -ldflags "-s -w" -o $(KWOK_CACHE).tmp/kwok sigs.k8s.io/kwok/cmd/kwok
	$(KWOK_CACHE).tmp/kwok --version
	rm -rf $(KWOK_CACHE) && mv $(KWOK_CACHE).tmp $(KWOK_CACHE)
	touch $@

# The cluster tests alone (the full suite runs them too).
test-k8s: $(STAMP) test-operator-prereqs
	KVPILOT_REQUIRE_TOOLS=1 $(PY) -m pytest -q tests/k8s

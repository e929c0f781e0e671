package gitops

// The repository's kustomization.yaml, the one path Flux or Argo CD points at: it renders
// exactly the objects of crds/ and deploy/, and the real API server accepts them.

import (
	"path/filepath"
	"sort"
	"strings"
	"testing"
)

func names(out string) []string {
	list := strings.Fields(out)
	sort.Strings(list)
	return list
}

func TestKustomizationRendersCRDsAndDeploy(t *testing.T) {
	c := connect(t)
	rendered := c.must("kustomize", c.root)
	got, stderr, err := c.run(rendered, "create", "--dry-run=client", "-o", "name", "-f", "-")
	if err != nil {
		t.Fatalf("rendered objects: %v\n%s", err, stderr)
	}
	want := c.must("create", "--dry-run=client", "-o", "name",
		"-f", filepath.Join(c.root, "crds"), "-f", filepath.Join(c.root, "deploy"))
	if g, w := names(got), names(want); strings.Join(g, " ") != strings.Join(w, " ") {
		t.Fatalf("kustomization renders %v, crds/ and deploy/ hold %v", g, w)
	}

	// Namespaces first (a dry run creates nothing, so their objects would have nowhere to
	// go), then everything as a server-side dry run. Other tests on the shared cluster may
	// have applied the same cluster-scoped objects (the admission policy) with another
	// field manager; a dry run may take their fields over, it changes nothing.
	for _, name := range names(got) {
		if ns, ok := strings.CutPrefix(name, "namespace/"); ok {
			if _, _, err := c.run("", "get", "namespace", ns); err != nil {
				c.must("create", "namespace", ns)
			}
		}
	}
	if _, stderr, err := c.run(rendered, "apply", "--server-side", "--dry-run=server",
		"--force-conflicts", "--field-manager=rebound-tests", "-f", "-"); err != nil {
		t.Fatalf("the API server refuses the kustomization: %v\n%s", err, stderr)
	}
}

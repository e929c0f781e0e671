// Package devstack starts the real parts the tests run against: PostgreSQL from
// dev/postgres.sh and a rebound-sidecar binary with a policies file.
package devstack

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// RepoRoot is the repository's root (three levels above this file's package).
func RepoRoot() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Clean(filepath.Join(filepath.Dir(file), "..", "..", "..", ".."))
}

// StateDir is where the Go tests keep their servers' state and logs (.state/go-tests/NAME).
func StateDir(name string) string {
	return filepath.Join(RepoRoot(), ".state", "go-tests", name)
}

// Postgres is a server started by dev/postgres.sh.
type Postgres struct {
	State string
	URL   string
}

func postgresScript(args ...string) (string, error) {
	cmd := exec.Command(filepath.Join(RepoRoot(), "dev", "postgres.sh"), args...)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	if err := cmd.Run(); err != nil {
		return "", fmt.Errorf("dev/postgres.sh %s: %v: %s", strings.Join(args, " "), err, errb.String())
	}
	return out.String(), nil
}

// StartPostgres starts (or reuses) the server of state dir `state`.
func StartPostgres(state string) (*Postgres, error) {
	out, err := postgresScript("up", state)
	if err != nil {
		return nil, err
	}
	lines := strings.Split(strings.TrimSpace(out), "\n")
	return &Postgres{State: state, URL: lines[len(lines)-1]}, nil
}

// Env reads the KEY=VALUE lines of `dev/postgres.sh env`.
func (p *Postgres) Env() (map[string]string, error) {
	out, err := postgresScript("env", p.State)
	if err != nil {
		return nil, err
	}
	env := map[string]string{}
	for _, l := range strings.Split(strings.TrimSpace(out), "\n") {
		if k, v, ok := strings.Cut(l, "="); ok {
			env[k] = v
		}
	}
	return env, nil
}

// DataDir is the cluster's data directory, as recorded in STATE/postgres.env.
func (p *Postgres) DataDir() (string, error) {
	raw, err := os.ReadFile(filepath.Join(p.State, "postgres.env"))
	if err != nil {
		return "", err
	}
	for _, l := range strings.Split(string(raw), "\n") {
		if v, ok := strings.CutPrefix(l, "PG_ROOT="); ok {
			return filepath.Join(v, "data"), nil
		}
	}
	return "", fmt.Errorf("no PG_ROOT in %s/postgres.env", p.State)
}

// Stop stops the server and removes its state dir.
func (p *Postgres) Stop() error {
	_, err := postgresScript("down", p.State)
	return err
}

// Restart stops the server the way an operator would (SIGINT: PostgreSQL's fast shutdown,
// every committed transaction kept), waits for it to exit, and starts it again on the same
// port with the same data. down is how long it stays stopped.
func (p *Postgres) Restart(down time.Duration) error {
	data, err := p.DataDir()
	if err != nil {
		return err
	}
	raw, err := os.ReadFile(filepath.Join(data, "postmaster.pid"))
	if err != nil {
		return err
	}
	pid, err := strconv.Atoi(strings.SplitN(string(raw), "\n", 2)[0])
	if err != nil {
		return err
	}
	if err := syscall.Kill(pid, syscall.SIGINT); err != nil {
		return err
	}
	for end := time.Now().Add(30 * time.Second); ; {
		if _, err := os.Stat(fmt.Sprintf("/proc/%d", pid)); os.IsNotExist(err) {
			break
		}
		if time.Now().After(end) {
			return fmt.Errorf("postgres (pid %d) did not stop after SIGINT", pid)
		}
		time.Sleep(50 * time.Millisecond)
	}
	time.Sleep(down)
	again, err := StartPostgres(p.State)
	if err != nil {
		return err
	}
	if again.URL != p.URL {
		return fmt.Errorf("restarted at %s, was %s", again.URL, p.URL)
	}
	return nil
}

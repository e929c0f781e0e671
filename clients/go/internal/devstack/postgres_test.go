package devstack

import (
	"context"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// children lists the PIDs whose parent is pid (from /proc/*/stat).
func children(t *testing.T, pid int) []int {
	t.Helper()
	stats, _ := filepath.Glob("/proc/[0-9]*/stat")
	var out []int
	for _, s := range stats {
		raw, err := os.ReadFile(s)
		if err != nil {
			continue
		}
		// "pid (comm) state ppid ...": comm may hold spaces, so read after the last ')'.
		rest := strings.Fields(string(raw[strings.LastIndexByte(string(raw), ')')+1:]))
		if len(rest) > 1 && rest[1] == strconv.Itoa(pid) {
			n, _ := strconv.Atoi(filepath.Base(filepath.Dir(s)))
			out = append(out, n)
		}
	}
	return out
}

func alive(pid int) bool {
	_, err := os.Stat("/proc/" + strconv.Itoa(pid))
	return err == nil
}

// dev/postgres.sh: starts a server that accepts a connection on 127.0.0.1, is idempotent,
// and `down` stops the postmaster and all its children and removes the state dir.
func TestPostgresScriptStartsAcceptsAndStops(t *testing.T) {
	state := filepath.Join(t.TempDir(), "pg")
	pg, err := StartPostgres(state)
	if err != nil {
		t.Fatal(err)
	}
	defer pg.Stop()

	again, err := StartPostgres(state)
	if err != nil {
		t.Fatal(err)
	}
	if again.URL != pg.URL {
		t.Fatalf("second up: %q, first: %q", again.URL, pg.URL)
	}
	env, err := pg.Env()
	if err != nil {
		t.Fatal(err)
	}
	if env["PGHOST"] != "127.0.0.1" || env["DATABASE_URL"] != pg.URL {
		t.Fatalf("env: %v", env)
	}

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, pg.URL)
	if err != nil {
		t.Fatal(err)
	}
	var listen string
	var one int
	if err := conn.QueryRow(ctx, "SELECT current_setting('listen_addresses'), 1").Scan(&listen, &one); err != nil {
		t.Fatal(err)
	}
	if listen != "127.0.0.1" || one != 1 {
		t.Fatalf("listen_addresses=%q, 1=%d", listen, one)
	}
	conn.Close(ctx)

	data, err := pg.DataDir()
	if err != nil {
		t.Fatal(err)
	}
	raw, err := os.ReadFile(filepath.Join(data, "postmaster.pid"))
	if err != nil {
		t.Fatal(err)
	}
	pid, err := strconv.Atoi(strings.SplitN(string(raw), "\n", 2)[0])
	if err != nil {
		t.Fatal(err)
	}
	kids := children(t, pid)
	if !alive(pid) || len(kids) == 0 {
		t.Fatalf("postmaster %d alive=%v with children %v", pid, alive(pid), kids)
	}

	if err := pg.Stop(); err != nil {
		t.Fatal(err)
	}
	for _, p := range append([]int{pid}, kids...) {
		if alive(p) {
			t.Errorf("process %d still running after down", p)
		}
	}
	if _, err := os.Stat(state); !os.IsNotExist(err) {
		t.Errorf("state dir %s left behind: %v", state, err)
	}
	if _, err := os.Stat(data); !os.IsNotExist(err) {
		t.Errorf("data dir %s left behind: %v", data, err)
	}
}

func postmasterPID(t *testing.T, pg *Postgres) int {
	t.Helper()
	data, err := pg.DataDir()
	if err != nil {
		t.Fatal(err)
	}
	raw, err := os.ReadFile(filepath.Join(data, "postmaster.pid"))
	if err != nil {
		t.Fatal(err)
	}
	pid, err := strconv.Atoi(strings.SplitN(string(raw), "\n", 2)[0])
	if err != nil {
		t.Fatal(err)
	}
	return pid
}

// After the postmaster is killed (SIGKILL), `up` starts it again on the same port with
// the same data, once the old server's children have gone.
func TestPostgresScriptRestartsAfterCrash(t *testing.T) {
	state := filepath.Join(t.TempDir(), "pg")
	pg, err := StartPostgres(state)
	if err != nil {
		t.Fatal(err)
	}
	defer pg.Stop()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, pg.URL)
	if err != nil {
		t.Fatal(err)
	}
	// (synchronous_commit is off: the CHECKPOINT after the commit writes it out.)
	for _, sql := range []string{"CREATE TABLE kept (n int)", "INSERT INTO kept VALUES (7)", "CHECKPOINT"} {
		if _, err := conn.Exec(ctx, sql); err != nil {
			t.Fatal(err)
		}
	}
	conn.Close(ctx)
	old := postmasterPID(t, pg)
	if err := syscall.Kill(old, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	again, err := StartPostgres(state)
	if err != nil {
		t.Fatal(err)
	}
	if again.URL != pg.URL || postmasterPID(t, pg) == old {
		t.Fatalf("restarted at %q (pid %d), was %q (pid %d)", again.URL, postmasterPID(t, pg), pg.URL, old)
	}
	conn, err = pgx.Connect(ctx, pg.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	var n int
	if err := conn.QueryRow(ctx, "SELECT n FROM kept").Scan(&n); err != nil || n != 7 {
		t.Fatalf("kept row: %d, %v", n, err)
	}
}

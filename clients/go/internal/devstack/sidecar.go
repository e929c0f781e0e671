package devstack

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	pb "github.com/rebound-dev/rebound/clients/go/reboundv1"
)

// SidecarBinary is $REBOUND_SIDECAR, else target/debug/rebound-sidecar (cargo build -p rebound-sidecar).
func SidecarBinary() (string, error) {
	bin := os.Getenv("REBOUND_SIDECAR")
	if bin == "" {
		dir := os.Getenv("CARGO_TARGET_DIR")
		if dir == "" {
			dir = filepath.Join(RepoRoot(), "target")
		}
		bin = filepath.Join(dir, "debug", "rebound-sidecar")
	}
	if _, err := os.Stat(bin); err != nil {
		return "", fmt.Errorf("no sidecar at %s (cargo build -p rebound-sidecar): %w", bin, err)
	}
	return bin, nil
}

// DieWithParent makes a child process get SIGKILL when the test process dies (a test
// timeout panics without running cleanups).
func DieWithParent() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}

// FreePort is a TCP port on 127.0.0.1 that nothing listened on a moment ago.
func FreePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// Sidecar is a rebound-sidecar process; Args are its arguments besides the listener's.
type Sidecar struct {
	Args []string
	// Target is what a client dials: 127.0.0.1:PORT, or unix:///PATH with UDS set.
	Target string
	// UDS, when set, serves only on this socket (--uds PATH --no-tcp).
	UDS string
	Log string
	// ReadyQueue is asked with GetPolicy until it answers: the configuration is loaded.
	ReadyQueue string
	cmd        *exec.Cmd
}

// NewFileSidecar prepares a sidecar compiling `policies` (RetryPolicy YAML, written to
// dir/policies.yaml) for namespace `ns`, on a free port.
func NewFileSidecar(dir, ns, policies, readyQueue string) (*Sidecar, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	file := filepath.Join(dir, "policies.yaml")
	if err := os.WriteFile(file, []byte(policies), 0o644); err != nil {
		return nil, err
	}
	port, err := FreePort()
	if err != nil {
		return nil, err
	}
	return &Sidecar{
		Args:       []string{"--policies-file", file, "--namespace", ns, "--no-admin"},
		Target:     fmt.Sprintf("127.0.0.1:%d", port),
		Log:        filepath.Join(dir, "sidecar.log"),
		ReadyQueue: readyQueue,
	}, nil
}

// Start runs the sidecar and waits until it answers GetPolicy for ReadyQueue.
func (s *Sidecar) Start() error {
	bin, err := SidecarBinary()
	if err != nil {
		return err
	}
	args := append([]string{}, s.Args...)
	if s.UDS != "" {
		_ = os.Remove(s.UDS)
		args = append(args, "--uds", s.UDS, "--no-tcp")
		s.Target = "unix://" + s.UDS
	} else {
		args = append(args, "--listen", s.Target)
	}
	log, err := os.OpenFile(s.Log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	defer log.Close()
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = log, log
	cmd.SysProcAttr = DieWithParent()
	if err := cmd.Start(); err != nil {
		return err
	}
	s.cmd = cmd
	dial := s.Target
	if s.UDS == "" {
		dial = "passthrough:///" + s.Target
	}
	conn, err := grpc.NewClient(dial, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		s.Kill()
		return err
	}
	defer conn.Close()
	rpc := pb.NewRetryAdvisorClient(conn)
	end := time.Now().Add(30 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		_, err := rpc.GetPolicy(ctx, &pb.GetPolicyRequest{Queue: s.ReadyQueue}, grpc.WaitForReady(true))
		cancel()
		if err == nil {
			return nil
		}
		if time.Now().After(end) {
			s.Kill()
			return fmt.Errorf("sidecar at %s not ready (last: %v; log %s)", s.Target, status.Code(err), s.Log)
		}
		if status.Code(err) != codes.Unavailable && status.Code(err) != codes.DeadlineExceeded && status.Code(err) != codes.NotFound {
			s.Kill()
			return fmt.Errorf("sidecar at %s: %v (log %s)", s.Target, err, s.Log)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// Signal sends sig to the running sidecar (SIGSTOP hangs it, SIGCONT resumes it).
func (s *Sidecar) Signal(sig syscall.Signal) error {
	if s.cmd == nil {
		return fmt.Errorf("sidecar at %s not running", s.Target)
	}
	return s.cmd.Process.Signal(sig)
}

// Kill stops the sidecar with SIGKILL and waits for it (no-op when not running).
func (s *Sidecar) Kill() {
	if s.cmd == nil {
		return
	}
	_ = s.cmd.Process.Kill()
	_ = s.cmd.Process.Signal(syscall.SIGCONT) // a hung (stopped) sidecar dies at once
	_ = s.cmd.Wait()
	s.cmd = nil
}

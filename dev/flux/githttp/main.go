// Command githttp serves the Git repositories under a directory over Git's smart HTTP
// protocol (`git http-backend` as CGI) on a loopback address, for Flux's source-controller
// in tests: go-git, its Git client, speaks no dumb HTTP.
//
// Usage: githttp -root DIR [-listen 127.0.0.1:0] [-addr-file FILE]
//
// The address it listens on is printed on stdout (and written to -addr-file, atomically,
// when given) once the listener is open. Read-only: pushes are refused.
package main

import (
	"errors"
	"flag"
	"fmt"
	"log"
	"net"
	"net/http"
	"net/http/cgi"
	"os"
	"os/exec"
	"path/filepath"
	"time"
)

func main() {
	root := flag.String("root", "", "directory holding the repositories (DIR/NAME.git or DIR/NAME/.git)")
	listen := flag.String("listen", "127.0.0.1:0", "address to listen on (loopback only)")
	addrFile := flag.String("addr-file", "", "file to write the listen address to once it is open")
	flag.Parse()
	if err := run(*root, *listen, *addrFile); err != nil {
		log.Fatalf("githttp: %v", err)
	}
}

func run(root, listen, addrFile string) error {
	if root == "" {
		return errors.New("-root is required")
	}
	abs, err := filepath.Abs(root)
	if err != nil {
		return fmt.Errorf("-root: %w", err)
	}
	host, _, err := net.SplitHostPort(listen)
	if err != nil {
		return fmt.Errorf("-listen: %w", err)
	}
	if ip := net.ParseIP(host); ip == nil || !ip.IsLoopback() {
		return fmt.Errorf("-listen: %q is not a loopback address", listen)
	}
	git, err := exec.LookPath("git")
	if err != nil {
		return fmt.Errorf("git is not on PATH: %w", err)
	}
	backend := &cgi.Handler{
		Path: git,
		Args: []string{"http-backend"},
		Root: "/",
		Env: []string{
			"GIT_PROJECT_ROOT=" + abs,
			"GIT_HTTP_EXPORT_ALL=1",
		},
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		// Fetches only: upload-pack is what a clone or fetch asks for.
		if r.URL.Query().Get("service") == "git-receive-pack" || filepath.Base(r.URL.Path) == "git-receive-pack" {
			http.Error(w, "pushes are refused", http.StatusForbidden)
			return
		}
		start := time.Now()
		backend.ServeHTTP(w, r)
		log.Printf("%s %s %s", r.Method, r.URL.RequestURI(), time.Since(start).Round(time.Millisecond))
	})
	ln, err := net.Listen("tcp", listen)
	if err != nil {
		return fmt.Errorf("listening on %s: %w", listen, err)
	}
	addr := ln.Addr().String()
	if addrFile != "" {
		tmp := addrFile + ".tmp"
		if err := os.WriteFile(tmp, []byte(addr+"\n"), 0o644); err != nil {
			return fmt.Errorf("-addr-file: %w", err)
		}
		if err := os.Rename(tmp, addrFile); err != nil {
			return fmt.Errorf("-addr-file: %w", err)
		}
	}
	fmt.Println(addr)
	log.Printf("serving %s on http://%s", abs, addr)
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	return srv.Serve(ln)
}

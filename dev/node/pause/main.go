// Command pause is the sandbox container of the local node's Pods. No registry is
// reachable, so the node cannot pull registry.k8s.io/pause: this is the same idea in a
// few lines. It holds the Pod's namespaces, reaps the orphans it inherits as PID 1, and
// exits 0 on SIGINT or SIGTERM.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	signals := make(chan os.Signal, 8)
	signal.Notify(signals, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
	for s := range signals {
		if s != syscall.SIGCHLD {
			os.Exit(0)
		}
		for {
			pid, err := syscall.Wait4(-1, nil, syscall.WNOHANG, nil)
			if pid <= 0 || err != nil {
				break
			}
		}
	}
}

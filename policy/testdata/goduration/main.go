// Command goduration reads duration strings, one per line, and prints what the API
// server's checks make of each: whether the CRD pattern (argument 1, Go regexp as the
// API server's OpenAPI validation uses) matches, then Go's time.ParseDuration (behind
// CEL's duration()) in nanoseconds, or "error".
//
//	go run ./policy/testdata/goduration '^([0-9]+(\.[0-9]{1,9})?(ms|s|m|h))+$' < strings
package main

import (
	"bufio"
	"fmt"
	"os"
	"regexp"
	"time"
)

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: goduration PATTERN < strings")
		os.Exit(2)
	}
	pattern := regexp.MustCompile(os.Args[1])
	in := bufio.NewScanner(os.Stdin)
	out := bufio.NewWriter(os.Stdout)
	defer out.Flush()
	for in.Scan() {
		line := in.Text()
		match := 0
		if pattern.MatchString(line) {
			match = 1
		}
		d, err := time.ParseDuration(line)
		if err != nil {
			fmt.Fprintf(out, "%d error\n", match)
		} else {
			fmt.Fprintf(out, "%d %d\n", match, d.Nanoseconds())
		}
	}
	if err := in.Err(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}

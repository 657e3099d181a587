// Package leakcheck fails a test binary whose tests left goroutines behind.
package leakcheck

import (
	"fmt"
	"os"
	"testing"
	"time"

	"go.uber.org/goleak"
)

// settle is how long goroutines that are already ending (those of a pool,
// server or connection a test closed) get to finish on a loaded machine
// before they count as leaked. goleak.Find alone waits about half a second.
const settle = 10 * time.Second

// Find reports the goroutines, other than the caller's, still running after
// settle.
func Find() error {
	deadline := time.Now().Add(settle)
	for {
		err := goleak.Find()
		if err == nil || time.Now().After(deadline) {
			return err
		}
	}
}

// Run runs a test binary's tests, then each of closers, and fails the
// binary if any goroutine outlived them: every server, pool, cleaner and
// client a test starts must be stopped by it. Use it as
// os.Exit(leakcheck.Run(m)) in TestMain.
func Run(m *testing.M, closers ...func()) int {
	code := m.Run()
	for _, c := range closers {
		c()
	}
	if code == 0 {
		if err := Find(); err != nil {
			fmt.Fprintf(os.Stderr, "goleak: goroutines outlived the tests: %v\n", err)
			code = 1
		}
	}
	return code
}

// Package crashproc runs a test binary again as a child process that
// serves until it kills itself with SIGKILL at a chosen point, for tests
// that prove what survives a process dying between two steps.
//
// The parent starts the child with [Start]: the same binary, running no
// tests, with one environment variable that the binary's TestMain looks
// for to run the child's code instead. The child prints [Ready] when it
// serves, and calls [KillSelf] at its point.
package crashproc

import (
	"bytes"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/exactlyonce/idempotency/internal/testdb"
)

// Child is a running child process.
type Child struct {
	cmd     *exec.Cmd
	stderr  testdb.SyncBuffer
	exited  chan struct{}
	waitErr error
}

// Start runs the test binary as a child with env set (NAME=value entries)
// and files as its descriptors from 3 on, and waits until it is ready. The
// child is killed when t ends, if it still runs.
func Start(t testing.TB, env []string, files ...*os.File) *Child {
	t.Helper()
	c := &Child{exited: make(chan struct{})}
	c.cmd = exec.Command(os.Args[0], "-test.run=^$")
	c.cmd.Env = append(os.Environ(), env...)
	c.cmd.ExtraFiles = files
	ready := &readySignal{ch: make(chan struct{})}
	c.cmd.Stdout = ready
	c.cmd.Stderr = &c.stderr
	if err := c.cmd.Start(); err != nil {
		t.Fatalf("start child process: %v", err)
	}
	go func() {
		c.waitErr = c.cmd.Wait()
		close(c.exited)
	}()
	t.Cleanup(c.Kill)
	select {
	case <-ready.ch:
	case <-c.exited:
		t.Fatalf("child process exited before it was ready: %v\n%s", c.waitErr, c.stderr.String())
	case <-time.After(30 * time.Second):
		c.Kill()
		t.Fatalf("child process not ready after 30s\n%s", c.stderr.String())
	}
	return c
}

// RequireKilled waits for the child to kill itself at point, and fails t
// if it exits any other way, or reported a race or a panic first.
func (c *Child) RequireKilled(t testing.TB, point string) {
	t.Helper()
	select {
	case <-c.exited:
	case <-time.After(2 * time.Minute):
		c.Kill()
		t.Fatalf("child never reached kill point %s\n%s", point, c.stderr.String())
	}
	var ee *exec.ExitError
	if !errors.As(c.waitErr, &ee) {
		t.Fatalf("child exited with %v instead of being killed at %s\n%s", c.waitErr, point, c.stderr.String())
	}
	ws := ee.Sys().(syscall.WaitStatus)
	if !ws.Signaled() || ws.Signal() != syscall.SIGKILL {
		t.Fatalf("child exited with %v instead of being killed at %s\n%s", c.waitErr, point, c.stderr.String())
	}
	if out := c.stderr.String(); strings.Contains(out, "DATA RACE") || strings.Contains(out, "panic") {
		t.Fatalf("child reported a problem before the kill:\n%s", out)
	}
}

// Kill kills the child, if it still runs, and waits for it.
func (c *Child) Kill() {
	_ = c.cmd.Process.Kill()
	<-c.exited
}

// Stderr is what the child wrote to its standard error so far.
func (c *Child) Stderr() string { return c.stderr.String() }

// Listener is the listening socket the parent passed as the first of its
// files (descriptor 3).
func Listener() (net.Listener, error) { return net.FileListener(os.NewFile(3, "listener")) }

// Main runs a child's body and returns its exit code: 2, with the error on
// standard error, when it fails (a killed child never returns).
func Main(body func() error) int {
	if err := body(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	return 0
}

// Ready tells the parent that the child serves.
func Ready() { os.Stdout.WriteString("ready\n") }

// KillSelf kills the calling process with SIGKILL, and never returns:
// nothing after the point may happen.
func KillSelf() {
	_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
	select {}
}

// readySignal closes ch when the child prints its ready line.
type readySignal struct {
	once sync.Once
	ch   chan struct{}
}

func (r *readySignal) Write(p []byte) (int, error) {
	if bytes.Contains(p, []byte("ready")) {
		r.once.Do(func() { close(r.ch) })
	}
	return len(p), nil
}

package main

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/exactlyonce/idempotency/internal/testdb"
)

// TestMain fails the binary if any goroutine outlives the tests, and
// removes the server's binary if a test built it.
func TestMain(m *testing.M) {
	code := testdb.RunWithLeakCheck(m)
	if builtPath != "" {
		_ = os.RemoveAll(filepath.Dir(builtPath))
	}
	os.Exit(code)
}

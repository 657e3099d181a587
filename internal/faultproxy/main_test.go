package faultproxy

import (
	"os"
	"testing"

	"github.com/exactlyonce/idempotency/internal/leakcheck"
)

// TestMain fails the package's tests if any goroutine outlives them: every
// proxy, server and client a test starts must be closed by the test.
func TestMain(m *testing.M) { os.Exit(leakcheck.Run(m)) }

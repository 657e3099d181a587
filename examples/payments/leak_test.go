package payments_test

import (
	"os"
	"testing"

	"github.com/exactlyonce/idempotency/internal/testdb"
)

// TestMain fails the binary if any goroutine outlives the tests. Run as a
// child process of the provider tests, it is that process instead.
func TestMain(m *testing.M) {
	if os.Getenv(childEnv) != "" {
		os.Exit(runChild())
	}
	os.Exit(testdb.RunWithLeakCheck(m))
}

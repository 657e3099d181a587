package idempotency_test

import (
	"os"
	"testing"

	"github.com/exactlyonce/idempotency/internal/testdb"
)

// TestMain runs the tests and then fails the binary if any goroutine
// outlived them (see testdb.RunWithLeakCheck). Started as the server
// process of a test that needs one (crash_test.go, http_test.go,
// resend_test.go), the binary serves instead of testing.
func TestMain(m *testing.M) {
	if os.Getenv(crashChildEnv) != "" {
		os.Exit(runCrashChild())
	}
	if os.Getenv(httpCrashChildEnv) != "" {
		os.Exit(runHTTPCrashChild())
	}
	if os.Getenv(replicaChildEnv) != "" {
		os.Exit(runReplicaChild())
	}
	os.Exit(testdb.RunWithLeakCheck(m))
}

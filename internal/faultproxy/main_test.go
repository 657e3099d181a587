package faultproxy

import (
	"testing"

	"go.uber.org/goleak"
)

// TestMain fails the package's tests if any goroutine outlives them: every
// proxy, server and client a test starts must be closed by the test.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

package main

import (
	"os"
	"testing"

	"github.com/exactlyonce/idempotency/internal/testdb"
)

// TestMain fails the binary if any goroutine outlives the tests.
func TestMain(m *testing.M) { os.Exit(testdb.RunWithLeakCheck(m)) }

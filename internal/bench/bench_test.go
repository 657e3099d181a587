package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"regexp"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/idempotency/internal/testdb"
)

// TestMain fails the binary if the tool left a goroutine behind: every
// server, pool, cleaner and client it starts must be stopped by run.
func TestMain(m *testing.M) { os.Exit(testdb.RunWithLeakCheck(m)) }

// TestShort runs the tool as CI does, with -short: every scenario, the
// preload and the cleaner, for a few seconds. It checks that the run
// succeeds, reports every variant and cleans up after itself, not what the
// numbers are.
func TestShort(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var stdout, stderr bytes.Buffer
	err := run(ctx, []string{"-short", "-url", testdb.URL()}, &stdout, &stderr)
	require.NoError(t, err, "stderr:\n%s", stderr.String())

	for _, v := range []string{"fresh", "floor", "plain", "fresh/payments", "floor/payments", "plain/payments",
		"engine:execute", "engine:floor", "engine:plain", "engine:execute/payments", "engine:floor/payments", "engine:plain/payments",
		"replay", "unmarked-replay", "proxy-resend", "no-db", "contended", "no-key", "http-fresh", "http-plain", "fresh-5k", "fresh-5k+cleaner"} {
		require.Regexp(t, `(?m)^`+regexp.QuoteMeta(v)+`\s+\d+\s`, stdout.String(), "throughput row of %s", v)
	}
	require.Contains(t, stdout.String(), targetsTitle)
	require.Regexp(t, `(?m)^http\s+http-fresh / http-plain\s`, stdout.String(), "ratio row of the HTTP pair")
	for _, goal := range []string{"fresh throughput through gRPC >= 0.82x floor, payments handler", "fresh throughput, engine alone, >= 0.78x floor, trivial handler",
		"Go CPU per fresh call, engine alone, <= 1.15x floor's", "WAL bytes per fresh call <= floor's + 30%, trivial handler",
		"round trips per fresh first attempt == plain's", "replay (x-retry-attempt: 1): one round trip per call",
		"fresh / plain throughput, HTTP beside gRPC, trivial handler",
		"proxy resend of a finished key (idempotency-key-new: true, no retry marker): replayed, the handler never runs"} {
		require.Contains(t, stdout.String(), goal)
	}

	schema := regexp.MustCompile(`schema (bench_[0-9a-f]+)`).FindStringSubmatch(stderr.String())
	require.Len(t, schema, 2, "stderr names the schema:\n%s", stderr.String())
	var left bool
	require.NoError(t, testdb.Admin(t).QueryRow(ctx,
		`SELECT EXISTS (SELECT FROM pg_namespace WHERE nspname = $1)`, schema[1]).Scan(&left))
	require.False(t, left, "schema %s is dropped at the end", schema[1])
}

// TestFlags rejects contradictory flags with a usage error (exit status 2)
// before touching the database.
func TestFlags(t *testing.T) {
	for _, args := range [][]string{
		{"-scenarios", "fresh,bogus"},
		{"-handlers", "trivial,bogus"},
		{"-accounts", "0"},
		{"-cleaner"},
		{"-scenarios", "preload"},
		{"-keys", "v1"},
		{"-rounds", "0"},
		{"extra"},
	} {
		t.Run(fmt.Sprint(args), func(t *testing.T) {
			var stderr bytes.Buffer
			err := run(context.Background(), append(args, "-url", "postgres://unreachable.invalid/x"), &bytes.Buffer{}, &stderr)
			require.ErrorAs(t, err, new(usageError))
		})
	}
}

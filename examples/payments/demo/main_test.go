package main

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/idempotency/internal/testdb"
)

func TestDemoChargesExactlyOnce(t *testing.T) {
	var out bytes.Buffer
	rep, err := run(context.Background(), config{
		databaseURL: testdb.URL(), charges: 80, clients: 4, accounts: 3, dropRate: 0.3, providerDrop: 0.2, dupEvery: 5, seed: 7,
		providerForget: 2 * time.Second,
	}, &out)
	require.NoError(t, err, out.String())
	t.Log("\n" + out.String())
	require.True(t, rep.ok(), "demo verdict")
	require.Contains(t, out.String(), "verdict: PASS")
	require.Positive(t, rep.dropped, "the network did drop responses")
	require.EqualValues(t, 80, rep.executed)
	require.Equal(t, 16, rep.duplicatesSent)
	require.EqualValues(t, 2, rep.crashes, "a replica crashed twice between the provider's answer and its commit, once the provider had forgotten the key")
	require.EqualValues(t, 80, rep.providerCharges, "the provider charged each charge once")
	require.EqualValues(t, 80, rep.settled, "each ledger row names its provider charge")
	require.Positive(t, rep.providerReplays, "retries of dropped provider responses got the provider's first charges back")
	require.Contains(t, out.String(), "one provider charge per charge")
}

func TestDemoWithoutDatabaseExplains(t *testing.T) {
	_, err := run(context.Background(), config{
		databaseURL: "postgres://postgres@127.0.0.1:1/test?connect_timeout=2", charges: 1, clients: 1, accounts: 1,
	}, &bytes.Buffer{})
	require.Error(t, err)
	require.True(t, strings.Contains(err.Error(), "DATABASE_URL") && strings.Contains(err.Error(), "never falls back"), err.Error())
}

func TestDemoRejectsBadFlags(t *testing.T) {
	_, err := run(context.Background(), config{charges: 0, clients: 1, accounts: 1}, &bytes.Buffer{})
	require.Error(t, err)
}

package payments_test

import (
	"context"
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/idempotency/examples/payments/outbox"
	paymentsv1 "github.com/exactlyonce/idempotency/examples/payments/proto/payments/v1"
)

// A charge job that kills its worker on every try (SIGKILL after the
// provider answered, three workers in a row: a poison job, an OOM, a
// provider answer that crashes the process) keeps failing: River rescues
// it each time and records each rescue in the job's errors, and
// Outbox.FailingCharges counts those with the failures the worker
// records, so the operator sees the job. (It failed when only the
// worker's own records counted.)
func TestChargeJobWhoseWorkersKeepDyingIsListedAsFailing(t *testing.T) {
	w := newWorld(t, 0)
	w.enqueueOnly(t, "order-adv-poison-1", &paymentsv1.ChargeRequest{AccountId: "acct-1", AmountCents: 700})
	cfg := childConfig{Role: "worker", DatabaseURL: w.db.URL(), ProviderURL: w.providerURL, KillAfterProvider: 1}
	for range 3 {
		startChild(t, cfg).RequireKilled(t, "after the provider answered")
	}
	ctx := context.Background()
	var rescues int
	require.NoError(t, w.db.Pool.QueryRow(ctx, `SELECT coalesce(array_length(errors, 1), 0) FROM river_job`).Scan(&rescues))
	require.GreaterOrEqual(t, rescues, 2, "River rescued the job after each dead worker")

	ob, err := outbox.New(w.db.Pool, outbox.Config{})
	require.NoError(t, err)
	failing, err := ob.FailingCharges(ctx, 1)
	require.NoError(t, err)
	var raw json.RawMessage
	require.NoError(t, w.db.Pool.QueryRow(ctx, `SELECT to_jsonb(errors) FROM river_job`).Scan(&raw))
	require.Len(t, failing, 1, "the job failed %d times (River's errors %s), but FailingCharges lists nothing", rescues+1, raw)
}

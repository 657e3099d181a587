package payments_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/idempotency/examples/payments"
	"github.com/exactlyonce/idempotency/examples/payments/outbox"
	paymentsv1 "github.com/exactlyonce/idempotency/examples/payments/proto/payments/v1"
	"github.com/exactlyonce/idempotency/examples/payments/provider"
)

// The outbox's worker, what it does when a job comes back to a ledger row
// that is already decided, when the provider cannot be reached for a long
// time, and when the provider declines the charge.

// enqueueOnly serves a PaymentService that charges through an outbox with
// no worker in this process, and makes one charge through it.
func (w *world) enqueueOnly(t *testing.T, key string, req *paymentsv1.ChargeRequest) *paymentsv1.ChargeResponse {
	t.Helper()
	enqueue, err := outbox.New(w.db.Pool, outbox.Config{})
	require.NoError(t, err)
	client := w.serve(t, payments.NewServer(w.db.Pool, payments.WithOutbox(enqueue)), 0)
	resp, err := chargeUntilDone(context.Background(), client, key, req)
	require.NoError(t, err)
	return resp
}

// expireProviderKeys deletes the provider's stored keys, which is what
// their expiry does: a request sent again with one of them is a new one.
func (w *world) expireProviderKeys(t *testing.T) {
	t.Helper()
	_, err := w.db.Pool.Exec(context.Background(), `DELETE FROM `+pgx.Identifier{provider.KeyTable}.Sanitize())
	require.NoError(t, err)
	require.Zero(t, w.db.Count(t, `SELECT count(*) FROM `+pgx.Identifier{provider.KeyTable}.Sanitize()))
}

// The outbox's worker is killed (SIGKILL) after it settled the ledger row
// and before River recorded the job's completion. The provider's key then
// expires, and River rescues the job onto another worker: the provider
// would take the key as new and charge again. The worker reads the ledger
// row first, finds it settled, and completes the job without calling the
// provider: one provider charge, and the job completed.
func TestWorkerKilledAfterSettleDoesNotChargeAgain(t *testing.T) {
	// Not parallel: with its provider and child processes it needs about 30
	// of the server's connections, and the suite stays under its budget.
	w := newWorld(t, 0)
	w.enqueueOnly(t, "order-settled-crash-1", &paymentsv1.ChargeRequest{AccountId: "acct-1", AmountCents: 400})

	cfg := childConfig{Role: "worker", DatabaseURL: w.db.URL(), ProviderURL: w.providerURL, KillAfterSettle: 1}
	startChild(t, cfg).RequireKilled(t, "after the ledger row was settled")
	require.Equal(t, counts{providerCharges: 1, ledgerRows: 1, settled: 1}, w.counts(t), "the dead worker charged and settled")
	require.Equal(t, map[string]int{"running": 1}, w.jobStates(t), "River has not recorded the completion")

	w.expireProviderKeys(t)
	cfg.KillAfterSettle = 0
	startChild(t, cfg)
	w.waitFor(t, "the rescued job finished, or charged again", func() bool {
		states := w.jobStates(t)
		return states["completed"]+states["cancelled"]+states["discarded"] == 1 || w.counts(t).providerCharges > 1
	})
	require.Equal(t, counts{providerCharges: 1, ledgerRows: 1, settled: 1}, w.counts(t), "the rescued job charged nothing")
	require.Equal(t, map[string]int{"completed": 1}, w.jobStates(t))
	require.EqualValues(t, 1, w.provider.executed.Load())
}

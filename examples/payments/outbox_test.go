package payments_test

import (
	"context"
	"encoding/json"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/examples/payments"
	"github.com/exactlyonce/idempotency/examples/payments/outbox"
	paymentsv1 "github.com/exactlyonce/idempotency/examples/payments/proto/payments/v1"
	"github.com/exactlyonce/idempotency/examples/payments/provider"
	"github.com/exactlyonce/idempotency/internal/testdb"
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
	w.deadWorkerOutlived(t)

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

// startOutboxWith starts an outbox with a worker in this process, on cfg
// with the world's provider, stopped when t ends.
func (w *world) startOutboxWith(t *testing.T, cfg outbox.Config) *outbox.Outbox {
	t.Helper()
	cfg.Provider = w.providerClient(t)
	cfg.Store = w.store
	ob, err := outbox.New(w.db.Pool, cfg)
	require.NoError(t, err)
	require.NoError(t, ob.Start(context.Background()))
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		require.NoError(t, ob.Stop(ctx))
	})
	return ob
}

// logLines are the JSON lines of a slog logger.
type logLines struct{ testdb.SyncBuffer }

func (l *logLines) logger() *slog.Logger {
	return slog.New(slog.NewJSONHandler(&l.SyncBuffer, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

// find returns the lines at level whose attribute key has value.
func (l *logLines) find(t *testing.T, level slog.Level, key, value string) []map[string]any {
	t.Helper()
	var found []map[string]any
	for line := range strings.Lines(l.String()) {
		var m map[string]any
		require.NoError(t, json.Unmarshal([]byte(line), &m), line)
		if m["level"] == level.String() && m[key] == value {
			found = append(found, m)
		}
	}
	return found
}

// The provider cannot be reached (every connection to it is reset) for
// more tries than River's default 25, after which River used to discard
// the job: the ledger row stayed charged, the client had been told the
// charge was taken, and the provider was never charged. The job stays
// waiting through the outage, the operator's list shows it with its last
// error and its count, a Warn line names it, and when the provider comes
// back it is charged once and the job completes.
func TestOutboxOutageLongerThanRiversAttemptsChargesOnce(t *testing.T) {
	// Not parallel: with its provider and child processes it needs about 30
	// of the server's connections, and the suite stays under its budget.
	const failuresWanted = 40 // past River's MaxAttemptsDefault, 25
	w := newWorld(t, 0)
	w.providerURL = "http://" + w.proxy(t, strings.TrimPrefix(w.providerURL, "http://"), 0, 1)
	proxy := w.proxies[0]
	proxy.SetRefusing(true)
	var logs logLines
	ob := w.startOutboxWith(t, outbox.Config{RetryBase: time.Millisecond, RetryCap: 10 * time.Millisecond, WarnAfter: 5, Logger: logs.logger()})
	client := w.serve(t, payments.NewServer(w.db.Pool, payments.WithOutbox(ob)), 0)
	resp, err := chargeUntilDone(context.Background(), client, "order-outage-1", &paymentsv1.ChargeRequest{AccountId: "acct-1", AmountCents: 900})
	require.NoError(t, err, "the call commits its row and its job; the provider is the worker's business")

	ctx := context.Background()
	var failing []outbox.FailingCharge
	w.waitFor(t, "the job failed more often than River's default attempts, or finished", func() bool {
		failing, err = ob.FailingCharges(ctx, failuresWanted)
		require.NoError(t, err)
		states := w.jobStates(t)
		return len(failing) > 0 || states["completed"]+states["cancelled"]+states["discarded"] > 0
	})
	require.Len(t, failing, 1, "jobs %v", w.jobStates(t))
	f := failing[0]
	require.Equal(t, resp.GetChargeId(), f.ChargeID)
	require.Equal(t, "acct-1", f.AccountID)
	require.EqualValues(t, 900, f.AmountCents)
	require.GreaterOrEqual(t, f.Failures, failuresWanted)
	require.Contains(t, f.LastError, "provider charge", "the last error is the provider's")
	require.False(t, f.LastFailedAt.IsZero())
	require.GreaterOrEqual(t, proxy.Stats().ConnectionsRefused, int64(failuresWanted), "every failure was a try that reached the (refusing) network")
	require.Equal(t, counts{ledgerRows: 1}, w.counts(t))
	all, err := ob.FailingCharges(ctx, 1)
	require.NoError(t, err)
	require.Len(t, all, 1)
	warned := logs.find(t, slog.LevelWarn, "charge_id", resp.GetChargeId())
	require.NotEmpty(t, warned, "a Warn line names the failing charge")
	require.EqualValues(t, 5, warned[0]["failures"], "the first Warn line is at WarnAfter")

	proxy.SetRefusing(false)
	w.waitFor(t, "the job completed", func() bool {
		states := w.jobStates(t)
		return states["completed"]+states["cancelled"]+states["discarded"] > 0
	})
	require.Equal(t, map[string]int{"completed": 1}, w.jobStates(t), "never discarded")
	w.waitSettled(t, 1)
	require.Equal(t, counts{providerCharges: 1, ledgerRows: 1, settled: 1}, w.counts(t))
	require.EqualValues(t, 1, w.provider.executed.Load())
	failing, err = ob.FailingCharges(ctx, 1)
	require.NoError(t, err)
	require.Empty(t, failing, "a charge leaves the list when its job succeeds")
	var attempt, maxAttempts int
	require.NoError(t, w.db.Pool.QueryRow(ctx, `SELECT attempt, max_attempts FROM river_job`).Scan(&attempt, &maxAttempts))
	t.Logf("%d failed tries, %d connections refused, %d Warn lines; River's attempt %d of %d", f.Failures, proxy.Stats().ConnectionsRefused, len(warned), attempt, maxAttempts)
}

// The provider declines a charge above its limit with a stored 402
// (card_declined): the client's error is ErrDeclined with gRPC code
// InvalidArgument, the same key declines again, and no money moves. A
// call that charges inside itself and is declined releases its key: the
// retry runs again, and gets the decline its step recorded without
// reaching the provider.
func TestProviderDeclinesAboveItsLimit(t *testing.T) {
	w := newWorld(t, 0)
	ctx := context.Background()
	pc := w.providerClient(t)
	for range 2 {
		_, err := pc.Charge(idempotency.WithOutgoingKey(ctx, "direct-1"), "acct-1", provider.DefaultDeclineAbove+1)
		require.ErrorIs(t, err, provider.ErrDeclined)
		require.Equal(t, codes.InvalidArgument, status.Code(err))
		require.Contains(t, err.Error(), provider.DeclineCode)
	}
	require.EqualValues(t, 1, w.provider.executed.Load())
	require.EqualValues(t, 1, w.provider.replayed.Load(), "the decline is stored under its key")
	ch, err := pc.Charge(idempotency.WithOutgoingKey(ctx, "direct-2"), "acct-1", provider.DefaultDeclineAbove)
	require.NoError(t, err, "the limit itself is charged")
	require.EqualValues(t, provider.DefaultDeclineAbove, ch.AmountCents)

	client := w.serve(t, payments.NewServer(w.db.Pool, payments.WithProvider(pc)), 0)
	req := &paymentsv1.ChargeRequest{AccountId: "acct-2", AmountCents: provider.DefaultDeclineAbove + 1}
	for run := range 2 {
		reached := w.provider.executed.Load() + w.provider.replayed.Load()
		_, err := chargeUntilDone(ctx, client, "order-declined-in-call", req)
		require.Equal(t, codes.InvalidArgument, status.Code(err), "%v", err)
		require.Contains(t, err.Error(), provider.ErrDeclined.Error())
		if run == 0 {
			require.Equal(t, reached+1, w.provider.executed.Load()+w.provider.replayed.Load(), "the call ran and reached the provider")
		} else {
			require.Equal(t, reached, w.provider.executed.Load()+w.provider.replayed.Load(), "the re-run got the step's recorded decline, and did not reach the provider")
		}
	}
	require.EqualValues(t, 1, w.provider.replayed.Load(), "only the direct decline was sent again")
	require.Equal(t, counts{providerCharges: 1}, w.counts(t), "only the charge at the limit")
	bal, n, err := payments.Balance(ctx, w.db.Pool, "acct-2")
	require.NoError(t, err)
	require.Zero(t, bal)
	require.Zero(t, n)
}

// The provider declines a charge made inside the call, and the call's step
// records the decline as final. The provider then forgets its keys, and
// the client sends the same charge again under its key (a decline releases
// it): the re-run gets the recorded decline, InvalidArgument with the
// provider's answer, without calling the provider, which would have taken
// the key as new and answered again. A corrected charge under the same
// key is another request, so another step: the provider is asked, and
// charges it.
func TestRecordedDeclineIsReturnedWithoutCallingTheProvider(t *testing.T) {
	w := newWorld(t, 0)
	ctx := context.Background()
	client := w.serve(t, payments.NewServer(w.db.Pool, payments.WithProvider(w.providerClient(t))), 0)
	const key = "order-recorded-decline-1"
	req := &paymentsv1.ChargeRequest{AccountId: "acct-1", AmountCents: provider.DefaultDeclineAbove + 1}
	_, err := chargeUntilDone(ctx, client, key, req)
	require.Equal(t, codes.InvalidArgument, status.Code(err), "%v", err)
	first := status.Convert(err).Message()
	require.Contains(t, first, provider.DeclineCode)
	require.EqualValues(t, 1, w.provider.executed.Load(), "the provider declined once")

	w.expireProviderKeys(t)
	for range 2 {
		_, err = chargeUntilDone(ctx, client, key, req)
		require.Equal(t, codes.InvalidArgument, status.Code(err), "%v", err)
		require.Equal(t, first, status.Convert(err).Message(), "the recorded decline, word for word")
	}
	require.EqualValues(t, 1, w.provider.executed.Load(), "the re-runs did not call the provider")
	require.Zero(t, w.provider.replayed.Load())
	require.Equal(t, counts{}, w.counts(t), "no charge, no ledger row")

	resp, err := chargeUntilDone(ctx, client, key, &paymentsv1.ChargeRequest{AccountId: "acct-1", AmountCents: 900})
	require.NoError(t, err, "the corrected charge is another step")
	require.EqualValues(t, 900, resp.GetBalanceCents())
	require.EqualValues(t, 2, w.provider.executed.Load())
	require.Equal(t, counts{providerCharges: 1, ledgerRows: 1, settled: 1}, w.counts(t))
}

// A charge through the outbox above the provider's limit: the call
// succeeds (the ledger row and the balance are committed with the job),
// then the provider declines the worker's charge, and the worker records
// the decline in one transaction: the row marked declined, its amount
// taken out of the balance. GetBalance shows balance 0, no charges and one
// declined; the provider has no charge; the job is completed after one
// try, not retried.
func TestOutboxDeclinedChargeIsTakenOutOfTheBalance(t *testing.T) {
	w := newWorld(t, 0)
	var logs logLines
	ob := w.startOutboxWith(t, outbox.Config{RetryDelay: 20 * time.Millisecond, Logger: logs.logger()})
	client := w.serve(t, payments.NewServer(w.db.Pool, payments.WithOutbox(ob)), 0)
	ctx := context.Background()
	const amount = provider.DefaultDeclineAbove + 1
	resp, err := chargeUntilDone(ctx, client, "order-declined-outbox-1", &paymentsv1.ChargeRequest{AccountId: "acct-1", AmountCents: amount})
	require.NoError(t, err, "the call commits; the provider is the worker's business")
	require.EqualValues(t, amount, resp.GetBalanceCents())

	w.waitFor(t, "the job finished, or failed three times", func() bool {
		states := w.jobStates(t)
		failing, err := ob.FailingCharges(ctx, 3)
		require.NoError(t, err)
		return states["completed"]+states["cancelled"]+states["discarded"] > 0 || len(failing) > 0
	})
	require.Equal(t, map[string]int{"completed": 1}, w.jobStates(t))
	bal, err := client.GetBalance(ctx, &paymentsv1.GetBalanceRequest{AccountId: "acct-1"})
	require.NoError(t, err)
	require.Zero(t, bal.GetBalanceCents(), "the declined amount is out of the balance")
	require.Zero(t, bal.GetCharges(), "a declined charge is not counted as a charge")
	require.EqualValues(t, 1, bal.GetDeclinedCharges())
	require.Equal(t, counts{ledgerRows: 1}, w.counts(t), "no provider charge")
	row, err := payments.ReadLedger(ctx, w.db.Pool, resp.GetChargeId())
	require.NoError(t, err)
	require.Equal(t, payments.StatusDeclined, row.Status)
	require.False(t, row.Settled())
	require.EqualValues(t, 1, w.provider.executed.Load()+w.provider.replayed.Load(), "one try reached the provider")
	failing, err := ob.FailingCharges(ctx, 1)
	require.NoError(t, err)
	require.Empty(t, failing)
	require.NotEmpty(t, logs.find(t, slog.LevelWarn, "charge_id", resp.GetChargeId()), "a Warn line names the declined charge")
}

// Settling a declined row, or declining a settled one, is an error that
// changes nothing; declining a declined row again is a no-op that takes
// nothing more out of the balance.
func TestLedgerDeclineAndSettleRefuseEachOther(t *testing.T) {
	w := newWorld(t, 0)
	ctx := context.Background()
	require.NoError(t, payments.Migrate(ctx, w.db.Pool, w.store), "Migrate runs again on its own tables")
	settled := w.enqueueOnly(t, "order-ledger-1", &paymentsv1.ChargeRequest{AccountId: "acct-1", AmountCents: 300}).GetChargeId()
	declined := w.enqueueOnly(t, "order-ledger-2", &paymentsv1.ChargeRequest{AccountId: "acct-1", AmountCents: 200}).GetChargeId()
	totals := func() payments.Totals {
		t.Helper()
		tot, err := payments.ReadTotals(ctx, w.db.Pool, "acct-1")
		require.NoError(t, err)
		return tot
	}
	require.Equal(t, payments.Totals{BalanceCents: 500, Charges: 2}, totals())

	require.NoError(t, payments.Settle(ctx, w.db.Pool, settled, "pch_1"))
	err := payments.Decline(ctx, w.db.Pool, settled)
	require.ErrorIs(t, err, payments.ErrLedgerConflict)
	require.ErrorContains(t, err, "pch_1")

	require.NoError(t, payments.Decline(ctx, w.db.Pool, declined))
	require.NoError(t, payments.Decline(ctx, w.db.Pool, declined), "declining again is a no-op")
	err = payments.Settle(ctx, w.db.Pool, declined, "pch_2")
	require.ErrorIs(t, err, payments.ErrLedgerConflict)
	require.ErrorContains(t, err, "pch_2")
	row, err := payments.ReadLedger(ctx, w.db.Pool, declined)
	require.NoError(t, err)
	require.Equal(t, payments.LedgerEntry{ChargeID: declined, AccountID: "acct-1", AmountCents: 200, Status: payments.StatusDeclined}, row)
	require.Equal(t, payments.Totals{BalanceCents: 300, Charges: 1, DeclinedCharges: 1}, totals())

	require.ErrorIs(t, payments.Decline(ctx, w.db.Pool, "ch_none"), payments.ErrNoLedgerRow)
	require.ErrorIs(t, payments.Settle(ctx, w.db.Pool, "ch_none", "pch_3"), payments.ErrNoLedgerRow)
	_, err = payments.ReadLedger(ctx, w.db.Pool, "ch_none")
	require.ErrorIs(t, err, payments.ErrNoLedgerRow)
}

// Issue case 3: the provider declines a charge made inside the call (402,
// stored under its key); the call fails with InvalidArgument, which
// releases the client's key; the client corrects the amount and sends it
// again under the same key, as the releasing codes invite. The corrected
// request is another operation, so it derives another key for the
// provider: charged, not refused as a reused key for good. The first
// request again still gets the provider's stored decline.
func TestCorrectedChargeAfterAnInCallDeclineIsCharged(t *testing.T) {
	w := newWorld(t, 0)
	ctx := context.Background()
	client := w.serve(t, payments.NewServer(w.db.Pool, payments.WithProvider(w.providerClient(t))), 0)

	const key = "order-corrected-1"
	_, err := chargeUntilDone(ctx, client, key, &paymentsv1.ChargeRequest{AccountId: "acct-3", AmountCents: provider.DefaultDeclineAbove + 1})
	require.Equal(t, codes.InvalidArgument, status.Code(err), "%v", err)
	require.Contains(t, err.Error(), provider.ErrDeclined.Error())

	resp, err := chargeUntilDone(ctx, client, key, &paymentsv1.ChargeRequest{AccountId: "acct-3", AmountCents: 900})
	require.NoError(t, err, "the corrected charge goes through under the released key")
	require.EqualValues(t, 900, resp.GetBalanceCents())
	require.Equal(t, counts{providerCharges: 1, ledgerRows: 1, settled: 1}, w.counts(t))
	require.EqualValues(t, 2, w.provider.executed.Load(), "the decline, then the corrected charge")

	again, err := chargeUntilDone(ctx, client, key, &paymentsv1.ChargeRequest{AccountId: "acct-3", AmountCents: 900})
	require.NoError(t, err)
	require.True(t, proto.Equal(resp, again), "a retry of the corrected charge replays it")
	require.EqualValues(t, 2, w.provider.executed.Load())
}

// A charge job that kills its worker on every try (SIGKILL after the
// provider answered, three workers in a row: a poison job, an OOM, a
// provider answer that crashes the process) keeps failing: River rescues
// it each time and records each rescue in the job's errors, and
// Outbox.FailingCharges counts those with the failures the worker
// records, so the operator sees the job. (It failed when only the
// worker's own records counted.)
func TestChargeJobWhoseWorkersKeepDyingIsListedAsFailing(t *testing.T) {
	w := newWorld(t, 0)
	w.enqueueOnly(t, "order-dying-workers-1", &paymentsv1.ChargeRequest{AccountId: "acct-1", AmountCents: 700})
	cfg := childConfig{Role: "worker", DatabaseURL: w.db.URL(), ProviderURL: w.providerURL, KillAfterProvider: 1}
	for i := range 3 {
		if i > 0 {
			w.deadWorkerOutlived(t)
		}
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

package payments_test

import (
	"context"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/examples/payments"
	paymentsv1 "github.com/exactlyonce/idempotency/examples/payments/proto/payments/v1"
)

// plainRiverOutbox enqueues with River's InsertTx on the call's
// transaction exactly as the handler gets it, no wrapper, as River's own
// documentation shows; the first enqueue loses its connection right after
// the job's INSERT (the database restarted, a proxy cut it).
type plainRiverOutbox struct {
	client *river.Client[pgx.Tx]
	db     interface {
		Exec(context.Context, string, ...any) (pgconn.CommandTag, error)
	}
	cut atomic.Bool
}

type riverChargeArgs struct{ payments.ChargeJob }

func (riverChargeArgs) Kind() string { return "payments_plain_river_charge" }

func (o *plainRiverOutbox) EnqueueCharge(ctx context.Context, tx pgx.Tx, job payments.ChargeJob) error {
	if _, err := o.client.InsertTx(ctx, tx, riverChargeArgs{job}, nil); err != nil {
		return err
	}
	if o.cut.CompareAndSwap(false, true) {
		var pid int
		if err := tx.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid); err != nil {
			return err
		}
		if _, err := o.db.Exec(ctx, `SELECT pg_terminate_backend($1)`, pid); err != nil {
			return err
		}
		// The call's connection is gone: its next statement fails.
		_, err := tx.Exec(ctx, `SELECT 1`)
		return err
	}
	return nil
}

// Issue case 8: River's pgx driver reads the query mode from the value it
// is given: from its Config method when it has one, else from tx.Conn().
// The call's transaction has Config, so River never takes the connection,
// and a connection lost during the call releases the key like any other
// lost connection: the client's retry charges once. Had River taken the
// connection, the engine would have had to assume the handler might have
// committed on it, and kept a permanent Internal for the key: no job, no
// ledger row, every retry refused.
func TestRiverInsertTxOnTheCallsTxSurvivesALostConnection(t *testing.T) {
	w := newWorld(t, 0)
	rc, err := river.NewClient(riverpgxv5.New(w.db.Pool), &river.Config{})
	require.NoError(t, err)
	ob := &plainRiverOutbox{client: rc, db: w.db.Pool}
	client := w.serve(t, payments.NewServer(w.db.Pool, payments.WithOutbox(ob)), 0)

	resp, err := chargeUntilDone(context.Background(), client, "order-river-1", &paymentsv1.ChargeRequest{AccountId: "acct-1", AmountCents: 400})
	require.NoError(t, err, "the retry after the lost connection charges")
	require.True(t, ob.cut.Load(), "the first attempt lost its connection")
	require.EqualValues(t, 400, resp.GetBalanceCents())
	require.Equal(t, counts{ledgerRows: 1}, w.counts(t))
	require.Equal(t, 1, w.db.Count(t, `SELECT count(*) FROM river_job WHERE kind = 'payments_plain_river_charge'`), "one job, from the attempt that committed")
}

type savepointArgs struct{ N int }

func (savepointArgs) Kind() string { return "payments_savepoint" }

// River's InsertTx on a savepoint of the call's transaction, and on the
// transaction itself, beside the handler's own statements: River reads
// the query mode from Config, never takes the connection (the next call
// gets the same backend from a pool of one), and a job inserted in a
// savepoint rolled back is gone with it.
func TestRiverInsertTxOnASavepointKeepsTheConnection(t *testing.T) {
	w := newWorld(t, 0)
	pool := w.db.OpenPool(t, 1)
	store, err := idempotency.NewStore(pool)
	require.NoError(t, err)
	rc, err := river.NewClient(riverpgxv5.New(pool), &river.Config{})
	require.NoError(t, err)
	ctx := context.Background()
	pid := func(key string) (p int) {
		_, err := store.Execute(ctx, idempotency.Call{Key: key, Method: "m"}, func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
			if _, err := rc.InsertTx(ctx, tx, savepointArgs{1}, nil); err != nil {
				return nil, err
			}
			sp, err := tx.Begin(ctx)
			if err != nil {
				return nil, err
			}
			if _, err := rc.InsertTx(ctx, sp, savepointArgs{2}, nil); err != nil {
				return nil, err
			}
			if err := sp.Commit(ctx); err != nil {
				return nil, err
			}
			gone, err := tx.Begin(ctx)
			if err != nil {
				return nil, err
			}
			if _, err := rc.InsertTx(ctx, gone, savepointArgs{3}, nil); err != nil {
				return nil, err
			}
			if err := gone.Rollback(ctx); err != nil {
				return nil, err
			}
			return nil, tx.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&p)
		})
		require.NoError(t, err)
		return p
	}
	require.Equal(t, pid("river-1"), pid("river-2"), "the call's connection went back to the pool: River never took it")
	require.Equal(t, 4, w.db.Count(t, `SELECT count(*) FROM river_job WHERE kind = 'payments_savepoint'`), "two jobs per call; the rolled-back savepoint's is gone")
}

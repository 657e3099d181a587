package payments_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	"github.com/exactlyonce/idempotency"
)

type review2Args struct{ N int }

func (review2Args) Kind() string { return "payments_review2" }

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
			if _, err := rc.InsertTx(ctx, tx, review2Args{1}, nil); err != nil {
				return nil, err
			}
			sp, err := tx.Begin(ctx)
			if err != nil {
				return nil, err
			}
			if _, err := rc.InsertTx(ctx, sp, review2Args{2}, nil); err != nil {
				return nil, err
			}
			if err := sp.Commit(ctx); err != nil {
				return nil, err
			}
			gone, err := tx.Begin(ctx)
			if err != nil {
				return nil, err
			}
			if _, err := rc.InsertTx(ctx, gone, review2Args{3}, nil); err != nil {
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
	require.Equal(t, 4, w.db.Count(t, `SELECT count(*) FROM river_job WHERE kind = 'payments_review2'`), "two jobs per call; the rolled-back savepoint's is gone")
}

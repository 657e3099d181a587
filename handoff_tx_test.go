package idempotency_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/internal/testdb"
)

// Reading Config hands out no connection (the next call gets the same
// backend), and works on a savepoint.
func TestConfigHandsOutNoConnection(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 1)
	store := migratedStore(t, db)
	pid := func(key string, read bool) (p int) {
		_, err := store.Execute(context.Background(), idempotency.Call{Key: key, Method: "m"}, func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
			if read {
				require.NotNil(t, tx.(configuredTx).Config())
				sp, err := tx.Begin(ctx)
				require.NoError(t, err)
				require.NotNil(t, sp.(configuredTx).Config())
				require.NoError(t, sp.Commit(ctx))
			}
			return nil, tx.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&p)
		})
		require.NoError(t, err)
		return p
	}
	first := pid("a", true)
	require.Equal(t, first, pid("b", false), "the connection went back to the pool")
}

type configuredTx interface{ Config() *pgxpool.Config }

// The call's transaction has Config() for River's driver, which reads
// ConnConfig.DefaultQueryExecMode from it on every statement. Each call
// gets its own copy: a handler that changes what it got (to open a side
// pool in simple-protocol mode, say) changes nothing another call sees,
// River's query mode included. (It failed when one config was shared.)
func TestTxConfigOfOneCallCannotChangeAnothers(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 4)
	store := migratedStore(t, db)
	want := db.Pool.Config()
	calls := 0
	config := func(edit func(*pgxpool.Config)) *pgxpool.Config {
		var got *pgxpool.Config
		calls++
		_, err := store.Execute(context.Background(), idempotency.Call{Key: fmt.Sprintf("call-%d", calls), Method: "m"}, func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
			c, ok := tx.(configuredTx)
			require.True(t, ok)
			got = c.Config()
			require.NotNil(t, got)
			if edit != nil {
				edit(got)
			}
			return nil, nil
		})
		require.NoError(t, err)
		return got
	}
	config(func(c *pgxpool.Config) {
		c.MaxConns = 1
		c.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeSimpleProtocol
	})
	other := config(nil)
	require.Equal(t, want.ConnConfig.DefaultQueryExecMode, other.ConnConfig.DefaultQueryExecMode, "another call's Config reports the pool's query mode, not what one handler wrote")
	require.Equal(t, want.MaxConns, other.MaxConns)
}

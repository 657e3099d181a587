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

type review2Configured interface{ Config() *pgxpool.Config }

// The call's transaction has Config() for River's driver, which reads
// ConnConfig.DefaultQueryExecMode from it on every statement. It returns
// one *pgxpool.Config shared by every call of the store: a handler that
// changes what it got (as one may with pgxpool.Pool.Config, which returns
// a copy: say, to open a side pool in simple-protocol mode) changes what
// every later call's Config reports, River's query mode included.
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
			c, ok := tx.(review2Configured)
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

package idempotency_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	"github.com/exactlyonce/idempotency"
)

// Forget with the state "failed" deletes a failed record, so that the key
// runs again, and never a succeeded one: 16 redrives of one failed
// message at once, each forgetting and running the message again, apply
// it once. Any other state is refused, nothing forgotten.
func TestForgetFailedNeverForgetsAnAppliedEffect(t *testing.T) {
	t.Parallel()
	db := suiteDB(t)
	store := migratedStore(t, db)
	ctx := context.Background()
	m := idempotency.Message{Scope: "redrive", ID: "m-1", Body: []byte("100")}
	var applied atomic.Int64
	fail := func(context.Context, pgx.Tx) error { return idempotency.Final(errors.New("poison today")) }
	apply := func(context.Context, pgx.Tx) error { applied.Add(1); return nil }

	require.ErrorIs(t, store.Forget(ctx, m.Scope, "message m-1", "failed"), idempotency.ErrKeyNotFound)
	_, err := store.ProcessMessage(ctx, m, fail)
	require.True(t, idempotency.IsFinal(err))

	// A redrive: forget the failure, then deliver the message again.
	redrive := func() error {
		if err := store.Forget(ctx, m.Scope, "message m-1", "failed"); err != nil && !errors.Is(err, idempotency.ErrKeyNotFound) {
			return err
		}
		for {
			if _, err := store.ProcessMessage(ctx, m, apply); !idempotency.IsInProgress(err) {
				return err
			}
		}
	}
	var wg sync.WaitGroup
	errs := make([]error, 16)
	for i := range errs {
		wg.Go(func() { errs[i] = redrive() })
	}
	wg.Wait()
	// And one more, after them (an operator's repeated command).
	errs = append(errs, redrive())
	for i, err := range errs {
		if err != nil && !errors.Is(err, idempotency.ErrNotFailed) && !idempotency.IsInProgress(err) {
			t.Fatalf("redrive %d: %v", i, err)
		}
	}
	require.EqualValues(t, 1, applied.Load(), "the message is applied once")
	err = store.Forget(ctx, m.Scope, "message m-1", "failed")
	require.ErrorIs(t, err, idempotency.ErrNotFailed, "a succeeded record is kept")
	require.Contains(t, err.Error(), "succeeded")
	rec, err := store.Inspect(ctx, m.Scope, "message m-1")
	require.NoError(t, err)
	require.Equal(t, "succeeded", rec.State)

	// A gRPC call's stored final error is forgotten the same way.
	call := idempotency.Call{Scope: "redrive", Key: "k", Method: "m"}
	_, err = store.Execute(ctx, call, func(context.Context, pgx.Tx) (proto.Message, error) {
		return nil, idempotency.Final(fmt.Errorf("declined"))
	})
	require.Error(t, err)
	for _, state := range []string{"succeeded", "running", "Failed"} {
		require.ErrorContains(t, store.Forget(ctx, "redrive", "k", state), `use "failed", or "" for any`, state)
	}
	require.NoError(t, store.Forget(ctx, "redrive", "k", "failed"))
	require.ErrorIs(t, store.Forget(ctx, "redrive", "k", "failed"), idempotency.ErrKeyNotFound)
}

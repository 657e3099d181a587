package idempotency_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/internal/testdb"
)

// Under WithDerivedKeyVersion(1), counted keys are the first release's;
// named effects, which it did not have, derive version 2 keys, so a
// counted call to the target "effect charge" and the effect named
// "charge" never share a key. (It failed when a name was a version 1
// target "effect " + name.)
func TestVersion1EffectKeysDoNotCollideWithCountedKeys(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 2)
	for _, version := range []int{2, 1} {
		store := migratedStore(t, db, idempotency.WithDerivedKeyVersion(version))
		var named, counted string
		_, err := store.Execute(context.Background(), idempotency.Call{Scope: "s", Key: "k", Method: "m"}, func(ctx context.Context, _ pgx.Tx) (proto.Message, error) {
			named, _ = idempotency.EffectKey(ctx, "charge")
			counted, _ = idempotency.CountedKey(ctx, "effect charge")
			return nil, errRelease
		})
		require.ErrorIs(t, err, errRelease)
		require.NotEqual(t, named, counted, "version %d: the effect \"charge\" and the first call to the target \"effect charge\" are two effects", version)
	}
}

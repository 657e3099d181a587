package idempotency_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/internal/testdb"
)

// FuzzKeyMetadata feeds arbitrary idempotency-key metadata, one value or
// two, straight into the server interceptor, as the bytes of any client
// would arrive. A well-formed key (1 to 255 bytes, each 0x21 to 0x7E) is
// served and has exactly one row; anything else is InvalidArgument with an
// INVALID_KEY ErrorInfo and a BadRequest naming the metadata key, the
// handler does not run and no row is written. The seed corpus in
// testdata/fuzz/FuzzKeyMetadata runs with every go test; explore further
// with go test -run '^$' -fuzz FuzzKeyMetadata.
func FuzzKeyMetadata(f *testing.F) {
	db := testdb.New(f, 4)
	ctx := context.Background()
	store := migratedStore(f, db)
	_, err := db.Pool.Exec(ctx, `CREATE TABLE ledger (key text NOT NULL)`)
	require.NoError(f, err)
	icpt := idempotency.UnaryServerInterceptor(store)
	info := &grpc.UnaryServerInfo{FullMethod: methodCharge}

	f.Fuzz(func(t *testing.T, key, second string, twoValues bool) {
		vals := []string{key}
		if twoValues {
			vals = append(vals, second)
		}
		before := db.Count(t, `SELECT count(*) FROM idempotency_keys`)
		ran := false
		resp, err := icpt(metadata.NewIncomingContext(ctx, metadata.MD{idempotency.MetadataKey: vals}), wrapperspb.String("x"), info,
			func(ctx context.Context, _ any) (any, error) {
				ran = true
				_, err := idempotency.MustTxFromContext(ctx).Exec(ctx, `INSERT INTO ledger VALUES ($1)`, key)
				return wrapperspb.String("done"), err
			})
		if !twoValues && wellFormedKey(key) {
			require.NoError(t, err, "key %q", key)
			require.Equal(t, "done", resp.(*wrapperspb.StringValue).GetValue(), "key %q: served or replayed", key)
			require.Equal(t, 1, db.Count(t, `SELECT count(*) FROM idempotency_keys WHERE key = $1`, key))
			require.Equal(t, 1, db.Count(t, `SELECT count(*) FROM ledger WHERE key = $1`, key))
			return
		}
		require.Equal(t, codes.InvalidArgument, status.Code(err), "values %q: %v", vals, err)
		require.Equal(t, "INVALID_KEY", errorReason(err), "values %q", vals)
		var br *errdetails.BadRequest
		for _, d := range status.Convert(err).Details() {
			if v, ok := d.(*errdetails.BadRequest); ok {
				br = v
			}
		}
		require.NotNil(t, br, "values %q: InvalidArgument carries BadRequest", vals)
		require.Equal(t, idempotency.MetadataKey, br.GetFieldViolations()[0].GetField())
		require.False(t, ran, "values %q: the handler ran", vals)
		require.Equal(t, before, db.Count(t, `SELECT count(*) FROM idempotency_keys`), "values %q: a row was written", vals)
	})
}

// wellFormedKey is the documented key rule, written out independently of
// idempotency.ValidateKey: 1 to 255 bytes, each printable ASCII other than
// space.
func wellFormedKey(k string) bool {
	if len(k) < 1 || len(k) > 255 {
		return false
	}
	for i := 0; i < len(k); i++ {
		if k[i] < '!' || k[i] > '~' {
			return false
		}
	}
	return true
}

package idempotency_test

import (
	"bytes"
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/internal/testdb"
	"github.com/stretchr/testify/require"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// Malformed keys (empty, 256 characters, non-ASCII, control characters,
// two values) are covered by TestInvalidKeysAreRejectedAndWriteNothing and
// FuzzKeyMetadata, and a key reused with another body or method by
// TestKeyReusedWithDifferentRequest. This test adds sizes and reuse
// combinations: each hostile call gets exactly the specified code and
// writes no row and runs no handler.
func TestOversizedCallsAndReusedKeysGetTheirCodeAndWriteNothing(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envConfig{handler: func(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
		if _, err := idempotency.MustTxFromContext(ctx).Exec(ctx, `INSERT INTO ledger (note) VALUES ($1)`, fmt.Sprint(len(req.GetValue()))); err != nil {
			return nil, err
		}
		return wrapperspb.String(fmt.Sprintf("%d bytes", len(req.GetValue()))), nil
	}})
	ctx := context.Background()
	huge := strings.Repeat("h", 3<<20) // under gRPC's default 4 MiB message limit
	keyed := func(key string) context.Context {
		return metadata.AppendToOutgoingContext(ctx, idempotency.MetadataKey, key)
	}

	// The calls the hostile ones collide with.
	first := invoke(keyed("huge-key"), e.conn, methodCharge, huge)
	require.NoError(t, first.err, "a 3 MiB request with a valid key is served")
	require.NoError(t, e.call(ctx, methodCharge, "charge-key", "x").err)
	again := invoke(keyed("huge-key"), e.conn, methodCharge, huge)
	require.True(t, again.replayed, "a 3 MiB request replays")
	require.True(t, bytes.Equal(first.raw, again.raw))
	require.Less(t, e.db.Count(t, `SELECT max(pg_column_size(k.*)) FROM idempotency_keys k`), 4096,
		"a request is kept as its fingerprint, never stored whole")
	runs, keys, rows := e.runs.Load(), e.keyRows(), e.ledgerRows()

	for _, tc := range []struct {
		name   string
		ctx    context.Context
		method string
		body   string
		code   codes.Code
		reason string // ErrorInfo reason, "" for gRPC's own rejections
	}{
		{"3 MiB body, key reused with the last byte changed", keyed("huge-key"), methodCharge, huge[:len(huge)-1] + "H", codes.FailedPrecondition, "KEY_REUSED"},
		{"3 MiB body, key reused for another method", keyed("huge-key"), methodRefund, huge, codes.FailedPrecondition, "KEY_REUSED"},
		{"key reused for another method, same body", keyed("charge-key"), methodRefund, "x", codes.FailedPrecondition, "KEY_REUSED"},
		{"1 MiB key", keyed(strings.Repeat("k", 1<<20)), methodCharge, "x", codes.InvalidArgument, "INVALID_KEY"},
		{"1 MiB key of valid characters but for the length", keyed(strings.Repeat("~", 1<<20)), methodRefund, huge, codes.InvalidArgument, "INVALID_KEY"},
		// gRPC refuses this before any interceptor runs.
		{"5 MiB body, over the server's message limit", keyed("new-key"), methodCharge, strings.Repeat("x", 5<<20), codes.ResourceExhausted, ""},
	} {
		r := invoke(tc.ctx, e.conn, tc.method, tc.body)
		require.Equal(t, tc.code, status.Code(r.err), "%s: %v", tc.name, r.err)
		require.Equal(t, tc.reason, errorReason(r.err), tc.name)
		require.Less(t, proto.Size(status.Convert(r.err).Proto()), 2048, "%s: the error must not echo the input back", tc.name)
		require.Equal(t, runs, e.runs.Load(), "%s: handler ran", tc.name)
		require.Equal(t, keys, e.keyRows(), "%s: key rows", tc.name)
		require.Equal(t, rows, e.ledgerRows(), "%s: business rows", tc.name)
	}
}

// Scope and key are data, never SQL: a caller-chosen scope and keys full of
// quote, comment and LIKE characters each name their own call, are stored
// exactly as sent, and replay only their own response. (Hostile table and
// schema names are covered by TestMigrateIsIdempotentAndHonoursTableName.)
func TestScopeAndKeyCannotInjectSQL(t *testing.T) {
	t.Parallel()
	scopes := []string{"tenant", "tenant' OR '1'='1", "x'); DROP TABLE ledger; --", `"; DELETE FROM idempotency_keys; --`, `\`, "%"}
	keys := []string{"k", "k'", "k%", "k_", "%", "_", `\`, "$1", "';DROP_TABLE_ledger;--", `k"--`}
	e := newEnv(t, envConfig{opts: []idempotency.ServerOption{idempotency.WithScope(func(ctx context.Context) (string, error) {
		return metadata.ValueFromIncomingContext(ctx, "x-tenant")[0], nil // the caller's choice, unchecked
	})}})
	call := func(scope, key string) reply {
		ctx := metadata.AppendToOutgoingContext(context.Background(), "x-tenant", scope, idempotency.MetadataKey, key)
		return invoke(ctx, e.conn, methodCharge, "x")
	}
	first := map[[2]string][]byte{}
	for _, s := range scopes {
		for _, k := range keys {
			r := call(s, k)
			require.NoError(t, r.err, "scope %q key %q", s, k)
			require.False(t, r.replayed, "scope %q key %q must not match another call's row", s, k)
			first[[2]string{s, k}] = r.raw
		}
	}
	for _, s := range scopes {
		for _, k := range keys {
			r := call(s, k)
			require.True(t, r.replayed, "scope %q key %q", s, k)
			require.Equal(t, first[[2]string{s, k}], r.raw, "scope %q key %q replays its own response", s, k)
		}
	}
	n := len(scopes) * len(keys)
	require.EqualValues(t, n, e.runs.Load())
	require.Equal(t, n, e.ledgerRows(), "the ledger is intact")
	require.Equal(t, n, e.keyRows())
	for _, s := range scopes {
		for _, k := range keys {
			require.Equal(t, 1, e.db.Count(t, `SELECT count(*) FROM idempotency_keys WHERE scope = $1 AND key = $2`, s, k), "scope %q key %q stored as sent", s, k)
		}
	}
}

// errorReason is the ErrorInfo reason of err, "" when it has none.
func errorReason(err error) string {
	for _, d := range status.Convert(err).Details() {
		if ei, ok := d.(*errdetails.ErrorInfo); ok {
			return ei.GetReason()
		}
	}
	return ""
}

// A key sent as binary metadata (idempotency-key-bin) is a different
// header to gRPC; neither the client interceptor nor the server may run the
// call as if it had no key, or mint one beside it. Both refuse it.
func TestBinaryKeyIsRefusedByClientAndServer(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envConfig{opts: []idempotency.ServerOption{idempotency.WithKeyRequired()}})
	conn, _ := retryingClient(t, "passthrough:///"+e.addr, 2)
	for range 2 { // the same logical call, sent twice through the library's client
		ctx := metadata.AppendToOutgoingContext(context.Background(), idempotency.MetadataKey+"-bin", "order-77")
		err := conn.Invoke(ctx, methodCharge, wrapperspb.String("order 77"), &wrapperspb.StringValue{})
		require.Equal(t, codes.InvalidArgument, status.Code(err), "%v", err)
		require.True(t, hasInvalidKeyInfo(err), "%v", err)
	}
	require.Zero(t, e.arrived.Load(), "the client refuses before sending")

	// A client without the library's interceptor: the server refuses the
	// binary key even beside a text one.
	for _, md := range [][]string{
		{idempotency.MetadataKey + "-bin", "order-78"},
		{idempotency.MetadataKey, "order-78", idempotency.MetadataKey + "-bin", "order-78"},
	} {
		ctx := metadata.AppendToOutgoingContext(context.Background(), md...)
		r := invoke(ctx, e.conn, methodCharge, "order 78")
		require.Equal(t, codes.InvalidArgument, status.Code(r.err), "%v", r.err)
		require.True(t, hasInvalidKeyInfo(r.err), "%v", r.err)
	}
	require.Zero(t, e.runs.Load())
	require.Zero(t, e.ledgerRows())
	require.Zero(t, e.keyRows())
}

// A key sent as binary metadata is not silently ignored.
func TestServerRefusesBinaryKeyNamingTheTextHeader(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envConfig{opts: []idempotency.ServerOption{idempotency.WithKeyRequired()}})
	ctx := metadata.AppendToOutgoingContext(context.Background(), idempotency.MetadataKey+"-bin", "k")
	r := invoke(ctx, e.conn, methodCharge, "x")
	require.Equal(t, codes.InvalidArgument, status.Code(r.err))
	require.Contains(t, status.Convert(r.err).Message(), "send it as the text metadata idempotency-key")
	require.Equal(t, idempotency.MetadataKey+"-bin", badRequestField(t, r.err))
	require.EqualValues(t, 0, e.runs.Load())

	r = e.call(context.Background(), methodCharge, "", "x")
	require.Equal(t, codes.InvalidArgument, status.Code(r.err))
	require.Contains(t, status.Convert(r.err).Message(), "send it in the idempotency-key metadata", "the missing-key error names the header")

	optional := newEnv(t, envConfig{})
	r = invoke(ctx, optional.conn, methodCharge, "x")
	require.Equal(t, codes.InvalidArgument, status.Code(r.err), "refused even where a key is optional: the caller meant to send one")
	require.EqualValues(t, 0, optional.runs.Load())
}

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

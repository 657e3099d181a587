package idempotency_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/descriptorpb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/internal/testdb"
)

// What derived keys are made of: the operation (store, scope, key with its
// transport, method, request), and for each downstream effect its name or
// its target and ordinal. Two operations under one client key never share
// downstream keys; a re-run of one operation always sends the same.

// errRelease fails a call so that its key is released and the next
// Execute runs it again.
var errRelease = errors.New("release the key so the next Execute runs again")

// derivedKeys runs one call on store, releases its key, and returns the
// keys its handler derived: counted ones for targets "a", "b", "a", then
// the effect "charge".
func derivedKeys(t *testing.T, store *idempotency.Store, call idempotency.Call) []string {
	t.Helper()
	var got []string
	_, err := store.Execute(context.Background(), call, func(ctx context.Context, _ pgx.Tx) (proto.Message, error) {
		for _, target := range []string{"a", "b", "a"} {
			k, ok := idempotency.CountedKey(ctx, target)
			require.True(t, ok)
			got = append(got, k)
		}
		k, ok := idempotency.EffectKey(ctx, "charge")
		require.True(t, ok)
		got = append(got, k)
		return nil, errRelease
	})
	require.ErrorIs(t, err, errRelease)
	return got
}

// requireAllDiffer asserts that no key of a is one of b's.
func requireAllDiffer(t *testing.T, a, b []string, what string) {
	t.Helper()
	for _, k := range a {
		require.NotContains(t, b, k, "%s: derives other keys", what)
	}
}

// Issue case 2: two stores (two services) that receive the same client key
// for the same method and request send a shared provider different keys;
// so do two methods of one store, and a corrected request, after a release
// (issue case 3), while a re-run of the same request sends the same keys.
func TestTwoOperationsUnderOneClientKeyDeriveDifferentKeys(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 4)
	orders := migratedStore(t, db, idempotency.WithTable("", "order_keys"))
	billing := migratedStore(t, db, idempotency.WithTable("", "billing_keys"))
	eu := migratedStore(t, db, idempotency.WithTable("", "order_keys"), idempotency.WithDerivedKeyNamespace("eu"))
	call := idempotency.Call{Scope: "merchant-1", Key: "order-1001", Method: "/shop.v1.Orders/Pay", Fingerprint: []byte("amount=250")}

	first := derivedKeys(t, orders, call)
	requireDerived(t, first, "merchant-1", "order-1001")
	for _, k := range first {
		require.Len(t, k, 44, "within Square's limit of 45 characters: %q", k)
	}
	require.Equal(t, first, derivedKeys(t, orders, call), "a re-run of the same operation sends the same keys")

	otherMethod, corrected := call, call
	otherMethod.Method = "/shop.v1.Orders/Refund"
	corrected.Fingerprint = []byte("amount=200")
	for what, keys := range map[string][]string{
		"another store's table":                derivedKeys(t, billing, call),
		"another namespace on one table":       derivedKeys(t, eu, call),
		"another method, after a release":      derivedKeys(t, orders, otherMethod),
		"a corrected request, after a release": derivedKeys(t, orders, corrected),
	} {
		requireAllDiffer(t, first, keys, what)
	}
}

// Named effects do not count: the same name gives the same key however
// many goroutines ask, in whatever order, beside counted calls made only
// on some runs.
func TestEffectKeysDoNotDependOnOrderOrConcurrency(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 2)
	store := migratedStore(t, db)
	call := idempotency.Call{Scope: "s", Key: "k", Method: "m"}
	run := func(extraCalls int) map[string]string {
		keys := map[string]string{}
		var mu sync.Mutex
		_, err := store.Execute(context.Background(), call, func(ctx context.Context, _ pgx.Tx) (proto.Message, error) {
			for range extraCalls { // a conditional call, counted: it shifts nothing named
				idempotency.CountedKey(ctx, "POST /v1/charges")
			}
			var wg sync.WaitGroup
			for i := range 16 {
				wg.Go(func() {
					name := fmt.Sprintf("charge item-%d", i%4)
					k, ok := idempotency.EffectKey(ctx, name)
					require.True(t, ok)
					mu.Lock()
					defer mu.Unlock()
					if prev, seen := keys[name]; seen {
						require.Equal(t, prev, k, "one name, one key")
					}
					keys[name] = k
				})
			}
			wg.Wait()
			return nil, errRelease
		})
		require.ErrorIs(t, err, errRelease)
		return keys
	}
	first := run(0)
	require.Len(t, first, 4)
	require.Equal(t, first, run(3), "a re-run that makes other calls first sends the same named keys")
}

// WithDerivedKeyVersion(1) derives the keys of the releases before
// version 2, for the deploy that upgrades: a call that ran under the old
// release and runs again under the new one sends the keys it sent. The
// values are those of the first derivation, pinned (computed
// independently of this package's code).
func TestDerivedKeyVersion1KeepsTheFirstReleasesKeys(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 2)
	store := migratedStore(t, db, idempotency.WithDerivedKeyVersion(1))
	call := idempotency.Call{Scope: "s", Key: "k", Method: "m"}
	keys := derivedKeys(t, store, call)
	require.Equal(t, []string{
		"dk1-bjhXX6jtz1stDhBmgbdSYt0c1B6GAV-18t4mcts0w5Y",
		"dk1-SCpROsNjgpX3bi674x9mkAXKJp6IjFAOs3uV2XSUW1w",
		"dk1-ieqHiHV3HCw773JT2TQ7L_F-L6-EelDbBi5IrXNcIxI",
	}, keys[:3])
	call.Method, call.Fingerprint = "another", []byte("another")
	again := derivedKeys(t, store, call)
	require.Equal(t, keys[:3], again[:3], "version 1 knew neither method nor request")
	require.True(t, strings.HasPrefix(keys[3], "dk2-"), "named effects, new with version 2, derive version 2 keys: %q", keys[3])
	require.NotEqual(t, keys[3], again[3])

	for _, v := range []int{0, 4} {
		_, err := idempotency.NewStore(db.Pool, idempotency.WithDerivedKeyVersion(v))
		require.ErrorContains(t, err, "WithDerivedKeyVersion")
	}
	_, err := idempotency.NewStore(db.Pool, idempotency.WithDerivedKeyNamespace("\xff"))
	require.ErrorContains(t, err, "WithDerivedKeyNamespace")
}

// A deploy between a call's crash and its re-run: the new build knows a
// field of the request that the old one held as unknown. The request's
// digest ignores the schema, so the re-run derives the keys the first run
// sent; a corrected request derives others.
func TestDerivedKeysSurviveASchemaDeploy(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 8)
	store := migratedStore(t, db)
	oldSchema := paySchema(t, "proto3", []payField{{name: "amount", number: 1, kind: descriptorpb.FieldDescriptorProto_TYPE_INT64}}, false)
	newSchema := paySchema(t, "proto3", []payField{
		{name: "amount", number: 1, kind: descriptorpb.FieldDescriptorProto_TYPE_INT64},
		{name: "note", number: 2, kind: descriptorpb.FieldDescriptorProto_TYPE_STRING},
	}, false)
	var mu sync.Mutex
	var sent []string
	release := func(md protoreflect.MessageDescriptor) *grpc.ClientConn {
		return servePay(t, store, md, func(ctx context.Context, _ proto.Message) (any, error) {
			k, ok := idempotency.EffectKey(ctx, "charge")
			require.True(t, ok)
			mu.Lock()
			sent = append(sent, k)
			mu.Unlock()
			return nil, status.Error(codes.Unavailable, "the process dies before its commit")
		})
	}
	// Fields out of number order, as another language's client may send
	// them.
	body := varintField(bytesField(nil, 2, []byte("gift")), 1, 500)
	corrected := varintField(bytesField(nil, 2, []byte("gift")), 1, 400)
	for _, conn := range []*grpc.ClientConn{release(oldSchema), release(newSchema), release(newSchema)} {
		b := body
		if len(sent) == 2 {
			b = corrected
		}
		r := sendRaw(conn, "order-7", b)
		require.Equal(t, codes.Unavailable, status.Code(r.err), "%v", r.err)
	}
	require.Len(t, sent, 3)
	require.Equal(t, sent[0], sent[1], "the build that knows the field derives what the build that did not sent")
	require.NotEqual(t, sent[0], sent[2], "a corrected request is another operation downstream")
}

// A handler that retries its own downstream gRPC call (after an error that
// says nothing was done, or a lost answer), and makes one downstream call
// only on some runs: the calls named with WithEffect keep their keys, so
// the re-run's calls are replays and the downstream service executes each
// effect once. The call made with the handler's context after the handler
// returned is refused with ErrCallEnded; nothing reaches the service.
func TestNamedDownstreamGRPCCallsKeepTheirKeys(t *testing.T) {
	t.Parallel()
	var innerKeys keyLog
	inner := newEnv(t, envConfig{interceptors: []grpc.UnaryServerInterceptor{innerKeys.intercept}})
	innerConn := dialKeyed(t, inner.addr, idempotency.UnaryClientInterceptor(idempotency.WithMaxAttempts(1)))
	invoke := func(ctx context.Context, body string) error {
		return innerConn.Invoke(ctx, methodCharge, wrapperspb.String(body), &wrapperspb.StringValue{})
	}
	var runs atomic.Int64
	kept := make(chan context.Context, 1)
	outer := newEnv(t, envConfig{handler: func(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
		run := runs.Add(1)
		if run == 1 {
			// Only on the first run: an effect of its own.
			if err := invoke(idempotency.WithEffect(ctx, "audit"), "audit"); err != nil {
				return nil, err
			}
		}
		charge := idempotency.WithEffect(ctx, "charge "+req.GetValue())
		for range 2 { // the handler's own retry of the same effect
			if err := invoke(charge, "charge"); err != nil {
				return nil, err
			}
		}
		if run == 1 {
			select {
			case kept <- ctx:
			default:
			}
			return nil, status.Error(codes.Unavailable, "the first run fails after its downstream calls")
		}
		return req, nil
	}})
	require.Equal(t, codes.Unavailable, status.Code(outer.call(context.Background(), methodCharge, "outer-9", "order-9").err))
	require.NoError(t, outer.call(context.Background(), methodCharge, "outer-9", "order-9").err)

	keys := innerKeys.all()
	require.Len(t, keys, 5, "audit, charge twice; then charge twice")
	require.Equal(t, []string{keys[1], keys[1], keys[1], keys[1]}, keys[1:], "one named effect, one key, on both runs")
	require.EqualValues(t, 2, inner.execs.Load(), "the audit and one charge")

	ended := <-kept
	err := invoke(ended, "after the call")
	require.ErrorIs(t, err, idempotency.ErrCallEnded)
	require.Len(t, innerKeys.all(), 5, "nothing was sent")
	_, ok := idempotency.CountedKey(ended, "x")
	require.False(t, ok, "no key from a call that has ended")
	_, ok = idempotency.EffectKey(ended, "x")
	require.False(t, ok)
}

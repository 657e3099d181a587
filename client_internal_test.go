package idempotency

import (
	"context"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/retry"
	"github.com/stretchr/testify/require"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"
)

func TestUnitBackoff(t *testing.T) {
	t.Parallel()
	const base, ceiling = 50 * time.Millisecond, 2 * time.Second
	for attempt, want := range map[uint]time.Duration{1: 50 * time.Millisecond, 2: 100 * time.Millisecond, 3: 200 * time.Millisecond, 7: ceiling, 60: ceiling} {
		require.Equal(t, want, backoffDelay(attempt, base, ceiling, 0.5, 0), "attempt %d without jitter", attempt)
		require.Equal(t, time.Duration(float64(want)*0.8), backoffDelay(attempt, base, ceiling, 0, 0), "attempt %d, -20%%", attempt)
		require.Equal(t, time.Duration(float64(want)*1.2), backoffDelay(attempt, base, ceiling, 1, 0), "attempt %d, +20%%", attempt)
	}
	require.Equal(t, 3*time.Second, backoffDelay(1, base, ceiling, 0.5, 3*time.Second), "the server's RetryInfo is a lower bound")
}

// How the client picks a call's key, without a connection.
func TestUnitClientKeyChoice(t *testing.T) {
	t.Parallel()
	o := evaluateClientOptions(nil)
	ctx := context.Background()
	const method = "/no.such.Service/Charge" // unknown: gets a key by default

	k, inMD, err := o.keyFor(ctx, method, nil)
	require.NoError(t, err)
	require.False(t, inMD)
	require.EqualValues(t, 7, uuid.MustParse(k).Version(), "a generated key is a UUIDv7")

	// The interceptor sends the key alone: no marker that a server could
	// trust to skip looking for a stored result.
	sent := func(ctx context.Context) metadata.MD {
		var md metadata.MD
		err := o.interceptor(nil)(ctx, method, nil, nil, nil, func(ctx context.Context, _ string, _, _ any, _ *grpc.ClientConn, _ ...grpc.CallOption) error {
			md, _ = metadata.FromOutgoingContext(ctx)
			return nil
		})
		require.NoError(t, err)
		return md
	}
	for _, md := range []metadata.MD{sent(ctx), sent(WithOutgoingKey(ctx, "order-42")), sent(metadata.AppendToOutgoingContext(ctx, MetadataKey, "md"))} {
		require.Len(t, md.Get(MetadataKey), 1)
		require.Empty(t, md.Get("idempotency-key-new"))
	}

	k, inMD, err = o.keyFor(WithOutgoingKey(ctx, "order-42"), method, nil)
	require.NoError(t, err)
	require.Equal(t, "order-42", k)
	require.True(t, inMD, "WithOutgoingKey puts the key in the outgoing metadata, for calls no interceptor sees")
	k, _, err = o.keyFor(WithOutgoingKey(WithOutgoingKey(ctx, "order-41"), "order-42"), method, nil)
	require.NoError(t, err)
	require.Equal(t, "order-42", k, "a later WithOutgoingKey replaces an earlier one")

	k, inMD, err = o.keyFor(metadata.AppendToOutgoingContext(ctx, MetadataKey, "md"), method, nil)
	require.NoError(t, err)
	require.Equal(t, "md", k)
	require.True(t, inMD)

	_, _, err = o.keyFor(WithOutgoingKey(metadata.AppendToOutgoingContext(ctx, MetadataKey, "a"), "b"), method, nil)
	require.ErrorIs(t, err, ErrInvalidKey)
	require.ErrorContains(t, err, "set it one way only")
	_, _, err = o.keyFor(metadata.AppendToOutgoingContext(WithOutgoingKey(ctx, "a"), MetadataKey, "a"), method, nil)
	require.ErrorContains(t, err, "2 values in outgoing metadata, exactly one is allowed: set the key once", "one key sent twice is not two keys")
	_, _, err = o.keyFor(WithOutgoingKey(ctx, ""), method, nil)
	require.ErrorContains(t, err, "WithOutgoingKey: key is empty")

	_, _, err = o.keyFor(metadata.AppendToOutgoingContext(ctx, retry.AttemptMetadataKey, "1"), method, nil)
	require.ErrorIs(t, err, ErrChainOrder, "a retry attempt without a key")
	require.Equal(t, codes.Internal, status.Code(err))

	k, _, err = evaluateClientOptions([]ClientOption{WithKeysForUnknownMethods(false)}).keyFor(ctx, method, nil)
	require.NoError(t, err)
	require.Empty(t, k)
}

// The client's and the server's halves of the key API never see each
// other's key: one is the caller's choice for outgoing calls, the other the
// key of the call being served.
func TestUnitOutgoingAndCallKeysAreSeparate(t *testing.T) {
	t.Parallel()
	ctx := WithOutgoingKey(context.Background(), "abc")
	k, ok := IncomingKey(ctx)
	require.False(t, ok)
	require.Empty(t, k)

	served := withCall(context.Background(), &callTx{attempt: &attempt{callRun: &callRun{s: &Store{opts: defaultStoreOptions()}, tp: &transport{}, call: Call{Scope: "scope", Key: "served-key"}, key: "served-key"}}})
	k, ok = IncomingKey(served)
	require.True(t, ok)
	require.Equal(t, "served-key", k)
	chosen, _, err := evaluateClientOptions(nil).keyFor(WithEffect(served, "charge"), "/no.such.Service/Charge", nil)
	require.NoError(t, err)
	require.NotEqual(t, "served-key", chosen, "a served call's key is not reused for outgoing calls by accident")
}

// keyFor is keyWith with the policy resolved as the interceptor resolves it.
func (o *clientOptions) keyFor(ctx context.Context, method string, req any) (string, bool, error) {
	md, _ := metadata.FromOutgoingContext(ctx)
	return o.keyWith(ctx, method, policyForRequest(method, req), md)
}

// The defaults of the client interceptor, which the README's Client table lists:
// a budget that outlasts a failover, no count of attempts, no timeout per
// attempt.
func TestUnitClientDefaults(t *testing.T) {
	t.Parallel()
	o := evaluateClientOptions(nil)
	require.Equal(t, 30*time.Second, o.retryBudget, "WithRetryBudget")
	require.Zero(t, o.maxAttempts, "WithMaxAttempts: no limit")
	require.Zero(t, o.perAttemptTimeout, "WithPerAttemptTimeout: none, the call's deadline bounds an attempt")
	require.Equal(t, 50*time.Millisecond, o.backoffBase, "WithRetryBackoff base")
	require.Equal(t, 2*time.Second, o.backoffMax, "WithRetryBackoff max")
}

// How one call's retrying decides, attempt by attempt.
func TestUnitRetryState(t *testing.T) {
	t.Parallel()
	unavailable := status.Error(codes.Unavailable, "down")
	ctx := context.Background()

	rs := evaluateClientOptions([]ClientOption{WithMaxAttempts(3)}).newRetryState(ctx)
	require.True(t, rs.retriable(unavailable))
	require.True(t, rs.retriable(unavailable))
	require.False(t, rs.retriable(unavailable), "the third attempt is the last of WithMaxAttempts(3)")
	require.Contains(t, rs.stop, "WithMaxAttempts(3)")
	err := rs.explain(unavailable)
	require.Equal(t, codes.Unavailable, status.Code(err))
	require.ErrorIs(t, err, unavailable)
	require.Contains(t, status.Convert(err).Message(), "down (idempotency: gave up after 3 attempts")

	rs = evaluateClientOptions([]ClientOption{WithMaxAttempts(1)}).newRetryState(ctx)
	require.False(t, rs.retriable(unavailable), "WithMaxAttempts(1) turns retries off")
	require.Same(t, unavailable, rs.explain(unavailable), "the one attempt's error, as it came")

	rs = evaluateClientOptions(nil).newRetryState(ctx)
	require.False(t, rs.retriable(status.Error(codes.NotFound, "no")), "not a retry code")
	require.Empty(t, rs.stop, "an answer, not a limit")
	require.Nil(t, rs.explain(nil))
	require.True(t, rs.retriable(ErrAttemptTimeout.with("m", nil)), "an attempt cut by its timeout is retried")

	withInfo, _ := status.New(codes.Unavailable, "down").WithDetails(&errdetails.RetryInfo{RetryDelay: durationpb.New(3 * time.Second)})
	require.True(t, rs.retriable(withInfo.Err()))
	require.Equal(t, 3*time.Second, rs.next, "the server's RetryInfo is a lower bound")

	rs = evaluateClientOptions([]ClientOption{WithRetryBudget(time.Millisecond)}).newRetryState(ctx)
	require.False(t, rs.retriable(unavailable), "a wait of about 50ms would end past a budget of 1ms")
	require.Contains(t, rs.stop, "retry budget of 1ms (WithRetryBudget)")

	short, cancel := context.WithTimeout(ctx, time.Millisecond)
	defer cancel()
	rs = evaluateClientOptions(nil).newRetryState(short)
	require.False(t, rs.retriable(unavailable))
	require.Contains(t, rs.stop, "the call's deadline")
	require.Contains(t, rs.explain(unavailable).Error(), "gave up after 1 attempt in")
}

// WithMaxAttempts(1) makes the interceptor the key alone, with no retry
// interceptor inside: a keyed call is sent once, a retry interceptor of the
// application's below it sees none of this package's retry options, and
// WithPerAttemptTimeout bounds that one attempt, naming the option, as
// the interceptor with retries bounds each of its attempts.
func TestUnitKeyAlone(t *testing.T) {
	t.Parallel()
	const method = "/no.such.Service/Charge"
	for _, c := range []struct {
		name    string
		opts    []ClientOption
		wantErr error
	}{
		{"the key alone", []ClientOption{WithMaxAttempts(1)}, nil},
		{"its one attempt bounded", []ClientOption{WithMaxAttempts(1), WithPerAttemptTimeout(time.Millisecond)}, ErrAttemptTimeout},
	} {
		var attempts int
		var seen []grpc.CallOption
		err := UnaryClientInterceptor(c.opts...)(WithOutgoingKey(context.Background(), "order-7"), method, nil, nil, nil,
			func(ctx context.Context, _ string, _, _ any, _ *grpc.ClientConn, opts ...grpc.CallOption) error {
				attempts++
				seen = opts
				if _, bounded := ctx.Deadline(); bounded {
					<-ctx.Done() // a server that hangs past the attempt's deadline
					return status.FromContextError(ctx.Err()).Err()
				}
				return status.Error(codes.Unavailable, "down")
			}, retry.WithMax(3))
		require.Equal(t, 1, attempts, c.name)
		require.Len(t, seen, 1, "%s: only the caller's own option goes below", c.name)
		if c.wantErr != nil {
			require.ErrorIs(t, err, c.wantErr, c.name)
			require.Contains(t, err.Error(), "WithPerAttemptTimeout", c.name)
		} else {
			require.Equal(t, codes.Unavailable, status.Code(err), c.name)
		}
	}
}

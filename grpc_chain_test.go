package idempotency_test

import (
	"context"
	"strconv"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/exactlyonce/idempotency"
)

// handRolledRetry is a retry interceptor of an application's own: it
// retries Unavailable once. marker, when set, is the metadata it adds to
// the retry (as go-grpc-middleware v1 and its many copies add
// x-retry-attempty); carryKey makes it capture the key of the first attempt
// and send the retry with it.
func handRolledRetry(marker string, carryKey bool) grpc.UnaryClientInterceptor {
	return func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		var key string
		first := opts
		if carryKey {
			first = append(first, idempotency.CaptureKey(&key))
		}
		err := invoker(ctx, method, req, reply, cc, first...)
		if status.Code(err) != codes.Unavailable {
			return err
		}
		if marker != "" {
			ctx = metadata.AppendToOutgoingContext(ctx, marker, strconv.Itoa(1))
		}
		if carryKey {
			ctx = idempotency.WithOutgoingKey(ctx, key)
		}
		return invoker(ctx, method, req, reply, cc, opts...)
	}
}

// A retry interceptor chained outside the key interceptor is caught when
// its retries say they are retries: go-grpc-middleware v2's marker and
// v1's (x-retry-attempty). A retry loop that says nothing cannot be told
// from a new call, and gets a new key per attempt (the second charge below);
// such a loop must carry the key itself, with CaptureKey and
// WithOutgoingKey, or run below the key interceptor.
func TestGRPCRetryOutsideTheKeyInterceptor(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name     string
		marker   string
		carryKey bool
		code     codes.Code
		charges  int
	}{
		{"go-grpc-middleware v1 marker", "x-retry-attempty", false, codes.Internal, 1},
		{"no marker", "", false, codes.OK, 2},
		{"no marker, the loop carries the key", "", true, codes.OK, 1},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			f := newFaultyEnv(t, 0, 7)
			conn := f.dial(t, grpc.WithChainUnaryInterceptor(handRolledRetry(c.marker, c.carryKey), idempotency.UnaryClientInterceptor(idempotency.WithMaxAttempts(1))))
			f.proxy.DropNextResponse()
			_, err := charge(context.Background(), conn, 0)
			require.Equal(t, c.code, status.Code(err), "%v", err)
			if c.code == codes.Internal {
				require.ErrorIs(t, err, idempotency.ErrChainOrder)
			}
			require.Equal(t, c.charges, f.ledgerRows(), "charges of the one logical call")
		})
	}
}

package idempotency_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/exactlyonce/idempotency"
)

// review31Failing serves the ledger's Charge with fail(n), n the attempt
// (from 1), and counts the attempts.
func review31Failing(t *testing.T, fail func(n int64) error, opts ...idempotency.ClientOption) (*grpc.ClientConn, *atomic.Int64) {
	t.Helper()
	var n atomic.Int64
	srv := grpc.NewServer()
	srv.RegisterService(ledgerDesc(), &ledger{handler: func(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
		if err := fail(n.Add(1)); err != nil {
			return nil, err
		}
		return wrapperspb.String("ok"), nil
	}})
	addr := serve(t, srv)
	conn, err := grpc.NewClient("passthrough:///"+addr, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithUnaryInterceptor(idempotency.UnaryClientInterceptor(opts...)))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	return conn, &n
}

func review31WithRetryInfo(c codes.Code, reason string, d time.Duration) error {
	st, err := status.New(c, "try later").WithDetails(
		&errdetails.ErrorInfo{Reason: reason, Domain: "idempotency"},
		&errdetails.RetryInfo{RetryDelay: durationpb.New(d)})
	if err != nil {
		panic(err)
	}
	return st.Err()
}

// A RetryInfo longer than what is left of the budget, or of the call's
// deadline, ends the retries at once: one attempt, the server's code and
// details kept, the message naming the limit. KEY_IN_PROGRESS with a short
// RetryInfo is retried until the key is free.
func TestReview31RetryInfoAgainstBudgetAndDeadline(t *testing.T) {
	t.Parallel()
	unavailable := func(int64) error {
		return review31WithRetryInfo(codes.Unavailable, "STORE_UNAVAILABLE", 10*time.Second)
	}

	conn, n := review31Failing(t, unavailable, idempotency.WithRetryBudget(time.Second))
	err := conn.Invoke(context.Background(), methodCharge, wrapperspb.String("x"), &wrapperspb.StringValue{})
	require.Equal(t, codes.Unavailable, status.Code(err))
	require.EqualValues(t, 1, n.Load())
	require.Contains(t, err.Error(), "WithRetryBudget")
	d, ok := idempotency.RetryDelay(err)
	require.True(t, ok)
	require.Equal(t, 10*time.Second, d, "the server's RetryInfo is kept")

	conn, n = review31Failing(t, unavailable)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	err = conn.Invoke(ctx, methodCharge, wrapperspb.String("x"), &wrapperspb.StringValue{})
	require.Equal(t, codes.Unavailable, status.Code(err), "%v", err)
	require.EqualValues(t, 1, n.Load())
	require.Contains(t, err.Error(), "deadline")

	conn, n = review31Failing(t, func(n int64) error {
		if n < 4 {
			return review31WithRetryInfo(codes.Aborted, "KEY_IN_PROGRESS", 20*time.Millisecond)
		}
		return nil
	}, idempotency.WithRetryBackoff(time.Millisecond, 2*time.Millisecond))
	require.NoError(t, conn.Invoke(context.Background(), methodCharge, wrapperspb.String("x"), &wrapperspb.StringValue{}))
	require.EqualValues(t, 4, n.Load())

	// WithMaxAttempts(2) against a budget that would allow more.
	conn, n = review31Failing(t, func(int64) error {
		return review31WithRetryInfo(codes.Unavailable, "STORE_UNAVAILABLE", time.Millisecond)
	},
		idempotency.WithMaxAttempts(2), idempotency.WithRetryBackoff(time.Millisecond, time.Millisecond))
	err = conn.Invoke(context.Background(), methodCharge, wrapperspb.String("x"), &wrapperspb.StringValue{})
	require.Equal(t, codes.Unavailable, status.Code(err))
	require.EqualValues(t, 2, n.Load())
	require.Contains(t, err.Error(), "WithMaxAttempts(2)")
}

package idempotency_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/exactlyonce/idempotency"
)

// A handler that sends its headers (grpc.SendHeader) and then fails: with a
// final error the client gets the headers and the error, and a retry gets
// both again, marked replayed; with a transient error it gets the headers
// and the error, and the retry runs again and gets its own headers. The
// same with the interceptor chained twice.
func TestReview31HandlerSendsHeadersThenFails(t *testing.T) {
	t.Parallel()
	for _, twice := range []bool{false, true} {
		var e *env
		cfg := envConfig{handler: func(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
			n := e.runs.Load()
			if err := grpc.SendHeader(ctx, metadata.Pairs("x-run", string(rune('0'+n)))); err != nil {
				return nil, err
			}
			_ = grpc.SetTrailer(ctx, metadata.Pairs("x-t", req.GetValue()))
			switch {
			case req.GetValue() == "final":
				return nil, status.Error(codes.FailedPrecondition, "declined")
			case req.GetValue() == "flaky" && n == 2:
				return nil, status.Error(codes.Unavailable, "downstream")
			}
			return wrapperspb.String("ok"), nil
		}}
		if twice {
			cfg.interceptors = []grpc.UnaryServerInterceptor{nil}
		}
		e = newEnvR31(t, cfg, twice)
		call := func(key, body string) (metadata.MD, metadata.MD, error) {
			var h, tr metadata.MD
			ctx := metadata.AppendToOutgoingContext(context.Background(), idempotency.MetadataKey, key)
			err := e.conn.Invoke(ctx, methodCharge, wrapperspb.String(body), &wrapperspb.StringValue{}, grpc.Header(&h), grpc.Trailer(&tr))
			return h, tr, err
		}
		h1, t1, err := call("k-final", "final")
		require.Equal(t, codes.FailedPrecondition, status.Code(err), "twice=%v", twice)
		require.Equal(t, []string{"1"}, h1.Get("x-run"))
		require.Equal(t, []string{"final"}, t1.Get("x-t"))
		h2, t2, err := call("k-final", "final")
		require.Equal(t, codes.FailedPrecondition, status.Code(err))
		require.Equal(t, []string{"1"}, h2.Get("x-run"), "twice=%v: the sent header is replayed", twice)
		require.Equal(t, []string{"final"}, t2.Get("x-t"))
		require.Equal(t, []string{"true"}, t2.Get(idempotency.ReplayedTrailer))

		h3, t3, err := call("k-flaky", "flaky")
		require.Equal(t, codes.Unavailable, status.Code(err), "twice=%v", twice)
		require.Equal(t, []string{"2"}, h3.Get("x-run"))
		require.Equal(t, []string{"flaky"}, t3.Get("x-t"))
		require.Empty(t, t3.Get(idempotency.ReplayedTrailer))
		h4, t4, err := call("k-flaky", "flaky")
		require.NoError(t, err)
		require.Equal(t, []string{"3"}, h4.Get("x-run"), "twice=%v: the retry's own header", twice)
		require.Empty(t, t4.Get(idempotency.ReplayedTrailer))
		require.EqualValues(t, 3, e.runs.Load())
	}
}

// newEnvR31 is newEnv, with the key interceptor chained twice when twice.
func newEnvR31(t *testing.T, cfg envConfig, twice bool) *env {
	t.Helper()
	cfg.interceptors = nil
	if !twice {
		return newEnv(t, cfg)
	}
	var e *env
	inner := func(ctx context.Context, req any, info *grpc.UnaryServerInfo, next grpc.UnaryHandler) (any, error) {
		return idempotency.UnaryServerInterceptor(e.store)(ctx, req, info, next)
	}
	cfg.interceptors = []grpc.UnaryServerInterceptor{func(ctx context.Context, req any, info *grpc.UnaryServerInfo, next grpc.UnaryHandler) (any, error) {
		return idempotency.UnaryServerInterceptor(e.store)(ctx, req, info, func(ctx context.Context, req any) (any, error) {
			return inner(ctx, req, info, next)
		})
	}}
	e = newEnv(t, cfg)
	return e
}

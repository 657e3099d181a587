package idempotencyconnect_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/idempotency"
	testingv1 "github.com/exactlyonce/idempotency/internal/testpb/idempotency/testing/v1"
)

// A handler that passes on the error of a downstream connect call as it
// got it (return nil, err): connect marks such an error as one from the
// wire and does not send its metadata (the downstream's response headers)
// to the upstream caller. The replay must not either.
func TestReview32bDownstreamErrorPassedOnIsReplayedAsSent(t *testing.T) {
	t.Parallel()
	down := newEnv(t)
	downURL := r32Mount(t, down.store, func(ctx context.Context, req *connect.Request[testingv1.Request]) (*connect.Response[testingv1.Response], error) {
		ce := connect.NewError(connect.CodeFailedPrecondition, errors.New("insufficient funds"))
		ce.Meta().Set("X-Downstream-Internal", "ledger-7")
		return nil, ce
	}, nil, nil, nil)
	up := newEnv(t)
	var runs atomic.Int64
	upURL := r32Mount(t, up.store, func(ctx context.Context, req *connect.Request[testingv1.Request]) (*connect.Response[testingv1.Response], error) {
		runs.Add(1)
		dc := client(t, downURL, procNoSideEffects, protocols[1], true)
		resp, err := dc.CallUnary(ctx, connect.NewRequest(req.Msg))
		if err != nil {
			return nil, err // passed on as it came
		}
		return connect.NewResponse(resp.Msg), nil
	}, nil, nil, nil)
	for _, p := range protocols {
		c := client(t, upURL, procRequired, p, true)
		key := "r32b-wire-" + p.name
		_, err1 := c.CallUnary(context.Background(), keyed(key, "w"))
		_, err2 := c.CallUnary(context.Background(), keyed(key, "w"))
		v1, v2 := r32View(t, err1), r32View(t, err2)
		require.Equal(t, connect.CodeFailedPrecondition, v1.code, "%s", p.name)
		require.NotContains(t, v1.meta, "x-downstream-internal", "%s: connect does not send a wire error's metadata", p.name)
		require.Equal(t, v1, v2, "%s: the replay", p.name)
	}
	require.EqualValues(t, len(protocols), runs.Load())
}

// A handler calls a downstream service protected by the idempotency layer
// through the client interceptor (a derived key), then fails transiently;
// the client retries, the re-run sends the same derived key, and the
// downstream replays its final error, with the replay marker among the
// error's metadata. The handler passes that error on, as it did the first
// time: the caller must get the downstream's FailedPrecondition, stored
// and replayed, not an Internal error about metadata it cannot store.
func TestReview32bDownstreamReplayedFinalErrorPassedOn(t *testing.T) {
	t.Parallel()
	down := newEnv(t)
	var downRuns atomic.Int64
	downURL := r32Mount(t, down.store, func(ctx context.Context, req *connect.Request[testingv1.Request]) (*connect.Response[testingv1.Response], error) {
		downRuns.Add(1)
		return nil, connect.NewError(connect.CodeFailedPrecondition, errors.New("insufficient funds"))
	}, nil, nil, nil)
	up := newEnv(t)
	var runs atomic.Int64
	upURL := r32Mount(t, up.store, func(ctx context.Context, req *connect.Request[testingv1.Request]) (*connect.Response[testingv1.Response], error) {
		n := runs.Add(1)
		dc := client(t, downURL, procRequired, protocols[1], false)
		_, err := dc.CallUnary(idempotency.WithEffect(ctx, "charge"), connect.NewRequest(req.Msg))
		if n == 1 {
			// The run fails after the downstream answered (its own
			// database hiccuped): the key is released and retried.
			return nil, connect.NewError(connect.CodeUnavailable, errors.New("try again"))
		}
		return nil, err
	}, nil, nil, nil)
	c := client(t, upURL, procRequired, protocols[1], false, idempotency.WithRetryBackoff(time.Millisecond, 5*time.Millisecond))
	_, err := c.CallUnary(context.Background(), connect.NewRequest(&testingv1.Request{Body: "r"}))
	require.Equal(t, connect.CodeFailedPrecondition, connectCode(err), "%v", err)
	require.EqualValues(t, 1, downRuns.Load(), "the downstream ran once")
	require.EqualValues(t, 2, runs.Load())
}

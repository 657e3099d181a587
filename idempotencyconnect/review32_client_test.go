package idempotencyconnect_test

import (
	"context"
	"errors"
	"net/http"
	"sync/atomic"
	"testing"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/idempotencyconnect"
	testingv1 "github.com/exactlyonce/idempotency/internal/testpb/idempotency/testing/v1"
)

// r32LoseFirst is a transport that delivers the first request and loses
// its answer (the connection broke after the server committed).
type r32LoseFirst struct {
	base http.RoundTripper
	n    atomic.Int64
}

func (l *r32LoseFirst) RoundTrip(r *http.Request) (*http.Response, error) {
	res, err := l.base.RoundTrip(r)
	if err == nil && l.n.Add(1) == 1 {
		_ = res.Body.Close()
		return nil, errors.New("connection reset by peer")
	}
	return res, err
}

// An application's own retry loop around a client whose interceptor makes
// one attempt (WithMaxAttempts(1)): the loop sends the same request again
// after the answer was lost, and the key the interceptor put on it the
// first time makes the second attempt a replay. So does a new request
// with the key captured (KeyOf) given to WithOutgoingKey, and one with the
// key as a header beside the same WithOutgoingKey.
func TestReview32ApplicationRetryLoopOutsideTheInterceptor(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var runs atomic.Int64
	url := r32Mount(t, e.store, r32Ledger(&runs), nil, nil, nil)
	ic, err := idempotencyconnect.NewClientInterceptor(idempotency.WithMaxAttempts(1))
	require.NoError(t, err)
	tr := &r32LoseFirst{base: httpClient(t, false).Transport}
	c := connect.NewClient[testingv1.Request, testingv1.Response](&http.Client{Transport: tr}, url+procRequired, connect.WithInterceptors(ic))
	ctx := context.Background()
	req := connect.NewRequest(&testingv1.Request{Body: "loop"})
	var resp *connect.Response[testingv1.Response]
	for range 3 {
		if resp, err = c.CallUnary(ctx, req); err == nil {
			break
		}
	}
	require.NoError(t, err)
	require.Equal(t, "true", resp.Trailer().Get(idempotency.ReplayedTrailer), "the loop's second send is a replay")
	key := idempotencyconnect.KeyOf(req)
	again, err := c.CallUnary(idempotency.WithOutgoingKey(ctx, key), connect.NewRequest(&testingv1.Request{Body: "loop"}))
	require.NoError(t, err)
	require.Equal(t, resp.Msg.GetLedgerId(), again.Msg.GetLedgerId())
	both := keyed(key, "loop")
	third, err := c.CallUnary(idempotency.WithOutgoingKey(ctx, key), both)
	require.NoError(t, err, "the same key both ways is one key")
	require.Equal(t, resp.Msg.GetLedgerId(), third.Msg.GetLedgerId())
	require.EqualValues(t, 1, runs.Load())
	require.Equal(t, 1, e.ledgerRows())

	bin := connect.NewRequest(&testingv1.Request{Body: "bin"})
	bin.Header().Set("Idempotency-Key-Bin", connect.EncodeBinaryHeader([]byte("k")))
	_, err = c.CallUnary(ctx, bin)
	require.Equal(t, connect.CodeInvalidArgument, connectCode(err), "the binary key refused by the client: %v", err)
	require.EqualValues(t, 1, runs.Load())
}

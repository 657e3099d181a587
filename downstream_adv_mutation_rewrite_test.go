package idempotency_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/exactlyonce/idempotency"
)

// Derived keys "depend on the running call's operation and on nothing the
// handler does". The request digest is taken lazily, at the first key a
// run derives, from the request object the handler holds, so what the
// handler does to its request before then changes the keys.

// A handler that scrubs its request before charging (it swaps the card
// number for a vault token, a new one on each run) derives the same key
// for its named effect on its re-run: the provider charges once. (It
// failed when the digest read the request the handler had changed.)
func TestHandlerRewritingItsRequestKeepsItsEffectKeys(t *testing.T) {
	t.Parallel()
	var runs atomic.Int64
	var keys keyLog
	e := newEnv(t, envConfig{handler: func(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
		run := runs.Add(1)
		req.Value = fmt.Sprintf("tok_%d", run) // the card number, replaced by this run's vault token
		k, ok := idempotency.EffectKey(ctx, "charge")
		require.True(t, ok)
		keys.add(k)
		if run == 1 {
			return nil, status.Error(codes.Unavailable, "the first run dies after charging")
		}
		return req, nil
	}})
	ctx := context.Background()
	require.Equal(t, codes.Unavailable, status.Code(e.call(ctx, methodCharge, "order-1", "4242424242424242").err))
	require.NoError(t, e.call(ctx, methodCharge, "order-1", "4242424242424242").err)
	k := keys.all()
	require.Len(t, k, 2)
	require.Equal(t, k[0], k[1], "the same operation (same key, method, request as sent) must send the same key for one named effect, whatever the handler did to its request object")
}

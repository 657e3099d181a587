package idempotency_test

import (
	"context"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/exactlyonce/idempotency"
)

// A string (or bytes) field whose content happens to parse as protobuf
// fields is hashed as bytes: "MangoEagle" and "EagleMango" (each two
// fixed32 fields, tags 'M' and 'E') derive different keys, as the engine
// tells the two requests apart. (It failed when such content was sorted
// like a message.)
func TestStringsThatParseAsMessagesDeriveOtherKeys(t *testing.T) {
	t.Parallel()
	var runs sync.Map
	var keys keyLog
	e := newEnv(t, envConfig{handler: func(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
		k, _ := idempotency.EffectKey(ctx, "charge")
		keys.add(k)
		if _, again := runs.LoadOrStore(req.GetValue(), true); !again && req.GetValue() == "MangoEagle" {
			return nil, status.Error(codes.Unavailable, "the first run dies after charging")
		}
		return req, nil
	}})
	ctx := context.Background()
	require.NoError(t, e.call(ctx, methodCharge, "stored-1", "EagleMango").err)
	requireKeyReused(t, e.call(ctx, methodCharge, "stored-1", "MangoEagle"), "the engine tells the two strings apart")

	require.Equal(t, codes.Unavailable, status.Code(e.call(ctx, methodCharge, "order-1", "MangoEagle").err))
	require.NoError(t, e.call(ctx, methodCharge, "order-1", "EagleMango").err, "another request under the released key")
	k := keys.all()
	require.Len(t, k, 3, "the refused request ran nothing")
	require.NotEqual(t, k[1], k[2], "two different requests (\"MangoEagle\", \"EagleMango\") must not derive the same downstream key")
}

package idempotency_test

import (
	"context"
	"fmt"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/exactlyonce/idempotency"
)

// The request's digest is taken before the handler runs: a handler that
// charges from 16 goroutines while it fills in a field of its request
// does not race with the library (run with -race). (It failed when the
// first key derived read the live request.)
func TestEffectKeyIgnoresWritesToTheRequest(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envConfig{handler: func(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
		var wg sync.WaitGroup
		for i := range 16 {
			wg.Go(func() { idempotency.EffectKey(ctx, fmt.Sprintf("charge item-%d", i)) })
		}
		req.Value = "normalised" // the handler's own field, written while its goroutines charge
		wg.Wait()
		return req, nil
	}})
	require.NoError(t, e.call(context.Background(), methodCharge, "order-2", "raw").err)
}

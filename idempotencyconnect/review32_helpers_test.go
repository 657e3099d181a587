package idempotencyconnect_test

import (
	"context"
	"net/http"
	"sync/atomic"
	"testing"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/reflect/protoreflect"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/idempotencyconnect"
	testingv1 "github.com/exactlyonce/idempotency/internal/testpb/idempotency/testing/v1"
)

// r32Unary is a connect handler of the test service's methods.
type r32Unary func(ctx context.Context, req *connect.Request[testingv1.Request]) (*connect.Response[testingv1.Response], error)

// r32Mount serves fn for every unary method named, behind the idempotency
// interceptor (with handler options before and after it), and returns the
// server's URL.
func r32Mount(t *testing.T, store *idempotency.Store, fn r32Unary, before, after []connect.Interceptor, hopts []connect.HandlerOption, opts ...idempotency.ServerOption) string {
	t.Helper()
	ic, err := idempotencyconnect.NewHandlerInterceptor(store, opts...)
	require.NoError(t, err)
	chain := append(append(append([]connect.Interceptor{}, before...), ic), after...)
	mux := http.NewServeMux()
	for _, name := range []protoreflect.Name{"Required", "NoSideEffects", "Optional", "Unannotated", "Disabled"} {
		m := method(name)
		path := "/" + string(m.Parent().FullName()) + "/" + string(m.Name())
		o := append([]connect.HandlerOption{connect.WithSchema(m)}, hopts...)
		o = append(o, connect.WithInterceptors(chain...))
		mux.Handle(path, connect.NewUnaryHandler(path, fn, o...))
	}
	return serve(t, mux)
}

// r32Ledger is the default work as a connect handler: a ledger row.
func r32Ledger(runs *atomic.Int64) r32Unary {
	return func(ctx context.Context, req *connect.Request[testingv1.Request]) (*connect.Response[testingv1.Response], error) {
		runs.Add(1)
		resp, err := ledger(ctx, req.Msg)
		if err != nil {
			return nil, err
		}
		return connect.NewResponse(resp), nil
	}
}

package payments

import (
	"context"
	"errors"
	"net/http"
	"strings"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/reflect/protoreflect"

	"github.com/exactlyonce/idempotency"
	paymentsv1 "github.com/exactlyonce/idempotency/examples/payments/proto/payments/v1"
	"github.com/exactlyonce/idempotency/idempotencyconnect"
)

// NewConnectHandler serves the PaymentService with connect-go, on the same
// business code and store as the gRPC and HTTP services: one handler that
// answers the Connect protocol (POST /payments.v1.PaymentService/Charge
// with a JSON or binary body, curl-able), gRPC and gRPC-Web, over HTTP/1.1
// and HTTP/2 without TLS. Callers authenticate as on the HTTP API
// ("Authorization: Bearer <token>"), and the caller is the idempotency
// scope: a key is the caller's own, whichever of connect's protocols it
// comes by.
//
// The handlers are built with connect.NewUnaryHandlerSimple from the
// generated messages and the method descriptors; protoc-gen-connect-go's
// generated constructor takes the same options.
func NewConnectHandler(svc *Server, store *idempotency.Store, callers Callers) (http.Handler, error) {
	ic, err := idempotencyconnect.NewHandlerInterceptor(store, idempotency.WithScope(CallerFromContext))
	if err != nil {
		return nil, err
	}
	methods := paymentsv1.File_payments_v1_payments_proto.Services().ByName("PaymentService").Methods()
	opts := func(name protoreflect.Name) []connect.HandlerOption {
		// Authentication first: the idempotency interceptor's scope is
		// the caller it finds.
		return []connect.HandlerOption{connect.WithSchema(methods.ByName(name)), connect.WithInterceptors(callers.connectAuth(), ic)}
	}
	mux := http.NewServeMux()
	const charge, balance = "/payments.v1.PaymentService/Charge", "/payments.v1.PaymentService/GetBalance"
	mux.Handle(charge, connect.NewUnaryHandlerSimple(charge, svc.Charge, opts("Charge")...))
	mux.Handle(balance, connect.NewUnaryHandlerSimple(balance, svc.GetBalance, opts("GetBalance")...))
	return mux, nil
}

// connectAuth is the connect interceptor that authenticates the caller
// from the Authorization header, as the HTTP API does.
func (c Callers) connectAuth() connect.Interceptor {
	return connect.UnaryInterceptorFunc(func(next connect.UnaryFunc) connect.UnaryFunc {
		return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
			if req.Spec().IsClient {
				return next(ctx, req)
			}
			scheme, token, ok := strings.Cut(req.Header().Get("Authorization"), " ")
			caller, known := c[strings.TrimSpace(token)]
			if !ok || !strings.EqualFold(scheme, "Bearer") || !known {
				return nil, connect.NewError(connect.CodeUnauthenticated, errors.New("send Authorization: Bearer <token> with a token of a known caller"))
			}
			return next(context.WithValue(ctx, callerKey{}, caller), req)
		}
	})
}

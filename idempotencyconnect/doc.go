// Package idempotencyconnect protects the unary calls of connect-go
// (connectrpc.com/connect) services with the idempotency engine: a call
// carrying an idempotency key runs at most once per key, its handler's
// writes commit with its stored response in one PostgreSQL transaction,
// and a retry gets that response, in whichever of connect's protocols
// (Connect, gRPC, gRPC-Web) it comes. It is the library's gRPC interceptor
// and client interceptors for connect-go, on the same engine (the Server
// and Client of github.com/exactlyonce/idempotency/unary), options, proto
// options and answers: a key
// sent to a connect handler and to a grpc-go server with
// idempotency.UnaryServerInterceptor on the same store is one call. It is
// a module of its own, so that the core library's go.mod has no connect.
//
// A server: the interceptor on every handler, after authentication.
//
//	ic, err := idempotencyconnect.NewHandlerInterceptor(store, idempotency.WithScope(callerOf))
//	...
//	path, handler := paymentsv1connect.NewPaymentServiceHandler(svc, connect.WithInterceptors(auth, ic))
//
// Handlers write through the call's transaction, as with gRPC:
//
//	tx := idempotency.MustTxFromContext(ctx)
//
// A client: one key per logical call, kept for its retries, which connect
// has no interceptor of its own for.
//
//	ic, err := idempotencyconnect.NewClientInterceptor()
//	...
//	client := paymentsv1connect.NewPaymentServiceClient(http.DefaultClient, url, connect.WithInterceptors(ic))
//
// # Replays without the response type in hand
//
// A connect interceptor returns a connect.AnyResponse, which only a
// *connect.Response[T] is, and T is fixed when the code is compiled. A
// replay must work in a process that never ran the method (after a
// deploy, on another replica), so it cannot borrow the type from a first
// run. connect-go's handler sends whatever message the response holds
// through its codec, so a replay's response holds the stored message,
// decoded with the method's response type from the global registry (the
// generated code of a served method is linked in), behind a wrapper type
// whose ProtoReflect is the message's: the Connect, gRPC and gRPC-Web
// encodings of a replay are those of the first response.
package idempotencyconnect

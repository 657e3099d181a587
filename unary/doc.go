// Package unary lends the idempotency engine to the unary calls of RPC
// frameworks other than grpc-go. Its users are adapters, such as
// github.com/exactlyonce/idempotency/idempotencyconnect for connect-go;
// a service uses an adapter, or [idempotency.UnaryServerInterceptor] and
// [idempotency.UnaryClientInterceptor] for grpc-go, never this package.
//
// [Server] is the server side: what UnaryServerInterceptor runs on, so
// that every framework's calls are decided, keyed, fingerprinted, stored
// and replayed the same way, and a key sent through one framework is the
// same call through any other on the same store and scope. An adapter
// hands [Server.Serve] the call as its framework received it and a
// [Handler] that runs the framework's handler, and sends the client the
// [Reply].
//
// [Client] is the client side, for a framework without a retry
// interceptor of its own: [Client.Invoke] picks the call's key and sends
// [Attempt]s until one succeeds or the retries end, as
// [idempotency.UnaryClientInterceptor] does for grpc-go, with the same
// options.
//
// Both speak gRPC's vocabulary, whatever the framework: metadata with
// lower-case keys ([metadata.MD]), errors read as gRPC statuses
// (status.FromError). An adapter converts its framework's headers and
// errors to and from them.
package unary

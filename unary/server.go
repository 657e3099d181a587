package unary

import (
	"context"
	"errors"

	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/internal/seam"
)

// Server protects the unary calls of an RPC framework, on a store, with
// the options [idempotency.UnaryServerInterceptor] takes: it is the engine
// that interceptor runs on.
type Server struct {
	s seam.Server
}

// NewServer returns the server side of the idempotency layer for unary
// calls on store, with the options [idempotency.UnaryServerInterceptor]
// takes. It fails if store is nil or an option is invalid, naming it.
func NewServer(store *idempotency.Store, opts ...idempotency.ServerOption) (*Server, error) {
	if store == nil {
		return nil, errors.New("unary: NewServer: store is nil")
	}
	s, err := seam.NewServer(store, opts)
	if err != nil {
		return nil, err
	}
	return &Server{s: s}, nil
}

// Call is a unary call as an RPC framework received it.
type Call struct {
	// Method is the call's full method, "/package.Service/Method" (gRPC's
	// :path, connect-go's procedure). Its descriptor decides whether the
	// call needs a key (see [idempotency.UnaryServerInterceptor]).
	Method string
	// Request is the decoded request.
	Request proto.Message
	// Metadata is the request's metadata (an HTTP framework's request
	// headers), with lower-case keys as gRPC has them: the key is read from
	// [idempotency.MetadataKey], and a retry is recognised by the markers
	// gRPC and the retry interceptors set.
	Metadata metadata.MD
	// Transport names the framework in traces
	// ([idempotency.TraceCallStartData]); empty is [idempotency.TransportGRPC].
	// It does not change the call: keys are shared by every framework's
	// unary calls.
	Transport idempotency.Transport
}

// Metadata is the headers and trailers of a response, with lower-case
// keys, as gRPC has them (binary keys' values as bytes).
type Metadata struct {
	Header, Trailer metadata.MD
	// Adapter is what a framework's adapter keeps beside them, to replay
	// them in the places its framework had them (idempotencyconnect keeps
	// which of connect's places each value came from): stored with them,
	// counted in [idempotency.MaxStoredMetadata], given back with a replay
	// whichever framework answers it, and ignored by the others.
	Adapter []byte
}

// Handler runs the framework's handler of a call, with ctx (which holds
// the call's transaction, see [idempotency.TxFromContext]). It returns the
// response or an error (a gRPC status error, or one convertible to one,
// such as [idempotency.Final]'s) and the headers and trailers the handler
// set: those are stored with a response or a final error and sent again
// with their replays. It may run more than once for one call (the engine
// runs it again after a transient failure of its own), each run on its
// own.
type Handler func(ctx context.Context) (proto.Message, Metadata, error)

// Reply is what an adapter sends the client: the response, or the error
// Serve returned, with the headers and trailers here.
type Reply struct {
	// Response is the handler's response, or its stored copy on a replay
	// (of the method's declared type when it is linked in; see
	// [idempotency.Result]). Nil with an error.
	Response proto.Message
	// Metadata is what goes with the response or error: the handler's own
	// when this run of the handler is the call's answer (it executed,
	// failed, or the call passed through), the stored headers and trailers
	// and [idempotency.ReplayedTrailer] on a replay, nothing on the
	// idempotency layer's own errors.
	Metadata
	// Outcome says what happened, as [idempotency.Store.Execute]'s; 0 when
	// the call passed through unprotected (its method needs no key, or
	// none was sent where none is required).
	Outcome idempotency.Outcome
}

// Serve runs call through the idempotency layer: a call that needs no key
// runs handler as it is; a keyed call runs handler at most once per key in
// the call's transaction, and a retry gets the stored answer. The error is
// the status the client gets: the handler's own (with its code, message
// and details), or the idempotency layer's (see [idempotency.ErrorDomain]).
func (s *Server) Serve(ctx context.Context, call Call, handler Handler) (Reply, error) {
	c := seam.Call{Method: call.Method, Request: call.Request, Metadata: call.Metadata, Transport: string(call.Transport)}
	r, err := s.s.Serve(ctx, c, func(ctx context.Context) (proto.Message, seam.Metadata, error) {
		resp, md, err := handler(ctx)
		return resp, seam.Metadata(md), err
	})
	return Reply{Response: r.Response, Metadata: Metadata(r.Metadata), Outcome: idempotency.Outcome(r.Outcome)}, err
}

// RefuseStream is what a framework's adapter answers a streaming call of
// method with md, its metadata: nil when the call may go on unprotected,
// else [idempotency.ErrStreamingUnsupported], as
// [idempotency.StreamServerInterceptor] answers. Streaming calls are not
// protected: one whose method the (idempotency.v1.method) option
// annotates, or that carries a key, is refused before its handler runs.
// req, the stream's first request when the adapter has it (nil before),
// finds the descriptor of a method that is not in the global registry.
func (s *Server) RefuseStream(method string, md metadata.MD, req proto.Message) error {
	return s.s.RefuseStream(method, md, req)
}

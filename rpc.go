package idempotency

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
)

// UnaryServer protects the unary calls of an RPC framework: it is what
// [UnaryServerInterceptor] runs on for grpc-go, and what an adapter of
// another framework runs on (github.com/exactlyonce/idempotency/idempotencyconnect
// is the one for connect-go), so that every framework's calls are decided,
// keyed, fingerprinted, stored and replayed the same way: a key sent
// through one of them is the same call through any other on the same store
// and scope.
//
// An adapter hands [UnaryServer.Serve] the call as the framework received
// it and a function that runs the framework's handler, and sends the
// client what Serve returns.
type UnaryServer struct {
	store *Store
	o     serverOptions
}

// NewUnaryServer returns the server side of the idempotency layer for
// unary calls on store, with the options [UnaryServerInterceptor] takes.
// It fails if store is nil or an option is invalid, naming it.
func NewUnaryServer(store *Store, opts ...ServerOption) (*UnaryServer, error) {
	if store == nil {
		return nil, fmt.Errorf("idempotency: NewUnaryServer: store is nil")
	}
	o := defaultServerOptions()
	for _, opt := range opts {
		opt(&o)
	}
	if err := o.validate(); err != nil {
		return nil, err
	}
	return &UnaryServer{store: store, o: o}, nil
}

// UnaryCall is a unary call as an RPC framework received it.
type UnaryCall struct {
	// Method is the call's full method, "/package.Service/Method" (gRPC's
	// :path, connect-go's procedure). Its descriptor decides whether the
	// call needs a key (see [UnaryServerInterceptor]).
	Method string
	// Request is the decoded request.
	Request proto.Message
	// Metadata is the request's metadata (an HTTP framework's request
	// headers), with lower-case keys as gRPC has them: the key is read from
	// [MetadataKey], and a retry is recognised by the markers gRPC and the
	// retry interceptors set.
	Metadata metadata.MD
	// Transport names the framework in traces ([TraceCallStartData]);
	// empty is [TransportGRPC]. It does not change the call: keys are
	// shared by every framework's unary calls.
	Transport Transport
}

// ResponseMetadata is the headers and trailers of a response, with
// lower-case keys, as gRPC has them (binary keys' values as bytes).
type ResponseMetadata struct {
	Header, Trailer metadata.MD
	// Adapter is what a framework's adapter keeps beside them, to replay
	// them in the places its framework had them (idempotencyconnect keeps
	// which of connect's places each value came from): stored with them,
	// counted in MaxStoredMetadata, given back with a replay whichever
	// framework answers it, and ignored by the others.
	Adapter []byte
}

// UnaryHandler runs the framework's handler of a call, with ctx (which
// holds the call's transaction, see [TxFromContext]). It returns the
// response or an error (a gRPC status error, or one convertible to one,
// such as [Final]'s) and the headers and trailers the handler set: those
// are stored with a response or a final error and sent again with their
// replays. It may run more than once for one call (the engine runs it
// again after a transient failure of its own), each run on its own.
type UnaryHandler func(ctx context.Context) (proto.Message, ResponseMetadata, error)

// UnaryReply is what an adapter sends the client: the response, or the
// error Serve returned, with the headers and trailers here.
type UnaryReply struct {
	// Response is the handler's response, or its stored copy on a replay
	// (of the method's declared type when it is linked in; see
	// [Result.Response]). Nil with an error.
	Response proto.Message
	// ResponseMetadata is what goes with the response or error: the
	// handler's own when this run of the handler is the call's answer (it
	// executed, failed, or the call passed through), the stored headers and
	// trailers and [ReplayedTrailer] on a replay, nothing on the
	// idempotency layer's own errors.
	ResponseMetadata
	// Outcome says what happened, as [Store.Execute]'s; 0 when the call
	// passed through unprotected (its method needs no key, or none was sent
	// where none is required).
	Outcome Outcome
}

// Serve runs call through the idempotency layer: a call that needs no key
// runs handler as it is; a keyed call runs handler at most once per key in
// the call's transaction, and a retry gets the stored answer. The error is
// the status the client gets: the handler's own (with its code, message
// and details), or the idempotency layer's (see codes.go).
func (s *UnaryServer) Serve(ctx context.Context, call UnaryCall, handler UnaryHandler) (UnaryReply, error) {
	p, err := s.prepare(ctx, call)
	if err == nil && p.passThrough {
		resp, md, err := handler(ctx)
		return UnaryReply{Response: resp, ResponseMetadata: md}, err
	}
	return s.protect(ctx, call, p, err, handler)
}

// plan is what prepare decided of a call.
type plan struct {
	passThrough bool
	key         string
	pol         methodPolicy
}

// prepare decides whether call is protected and with which key. An error
// (an invalid or missing key, a misconfigured method) is the call's answer.
func (s *UnaryServer) prepare(ctx context.Context, call UnaryCall) (plan, error) {
	pol := policyForRequest(call.Method, call.Request)
	if _, inCall := TxFromContext(ctx); (pol.mode == modePassThrough && pol.err == nil) || inCall {
		// The layer stacked twice (two interceptors chained) protects a
		// call once.
		return plan{passThrough: true}, nil
	}
	key, err := s.callKey(call.Metadata, pol, call.Request)
	if err == nil && key == "" {
		if pol.mode == modeOptional || (pol.mode == modeDefault && !s.o.requireKey) {
			return plan{passThrough: true}, nil
		}
		err = missingKey(pol)
	}
	return plan{key: key, pol: pol}, err
}

// protect runs a keyed call, or answers a call prepare refused (err).
func (s *UnaryServer) protect(ctx context.Context, call UnaryCall, p plan, err error, handler UnaryHandler) (_ UnaryReply, err2 error) {
	traceKey := p.key
	if vals := call.Metadata.Get(MetadataKey); traceKey == "" && len(vals) > 0 {
		traceKey = vals[0]
	}
	kind := call.Transport
	if kind == "" {
		kind = TransportGRPC
	}
	tp := &transport{kind: kind, finalCode: func(c codes.Code) bool { return s.o.final[c] }}
	outcome := OutcomeRejected
	if s.store.opts.tracer != nil {
		ctx, tp.trace = s.store.startCall(ctx, kind, call.Method, traceKey)
		defer tp.trace.endDeferred(ctx, &outcome, &err2)
	}
	if err != nil {
		return UnaryReply{Outcome: outcome}, err
	}
	res, md, err := s.execute(ctx, tp, call, p, handler)
	outcome = res.Outcome
	reply := UnaryReply{Outcome: res.Outcome}
	switch {
	case res.Outcome == OutcomeReplayed && (err == nil || IsFinal(err)):
		md, derr := decodeMD(res.metadata)
		if derr != nil {
			return reply, status.Errorf(codes.Internal, "idempotency: %v", derr)
		}
		md.Trailer = metadata.Join(md.Trailer, metadata.Pairs(ReplayedTrailer, "true"))
		reply.ResponseMetadata = md
	case res.ownAnswer:
		// This run's answer: its headers and trailers go with it. Any
		// other (a replay of another call's row, an error of the
		// engine's) is not this run's, and must not carry what its
		// rolled-back handler set.
		reply.ResponseMetadata = md
	}
	if err = unwrapFinal(err); err != nil { // a final error: the status stored for the key, as every caller gets it
		return reply, withSuggestedDelay(err, s.store.opts.retryDelay) // RetryInfo of the store's delay, as HTTP's Retry-After
	}
	if r := exactResponse(res); r != nil {
		reply.Response = r.(proto.Message)
	}
	return reply, nil
}

// callKey returns the key of a call: from the metadata, else from the
// method's key field; "" when it has none.
func (s *UnaryServer) callKey(md metadata.MD, pol methodPolicy, req proto.Message) (string, error) {
	if pol.err != nil {
		return "", status.Errorf(codes.Internal, "idempotency: misconfigured: %v", pol.err)
	}
	key, ok, err := keyFromIncoming(md)
	if err != nil || ok || pol.keyField == nil {
		return key, err
	}
	key = pol.keyFromField(req)
	if key == "" {
		return "", invalidKey(pol.keyPath, fmt.Sprintf("request field %s is empty and the call has no %s metadata", pol.keyPath, MetadataKey))
	}
	if err := ValidateKey(key); err != nil {
		return "", keyError(err, pol.keyPath, "request field "+pol.keyPath)
	}
	return key, nil
}

// execute runs a keyed call's handler through the engine; md is what the
// run whose answer the call got set.
func (s *UnaryServer) execute(ctx context.Context, tp *transport, call UnaryCall, p plan, handler UnaryHandler) (result, ResponseMetadata, error) {
	scope, err := s.o.scope(ctx)
	if err != nil {
		if _, ok := status.FromError(err); !ok {
			err = status.Errorf(codes.Internal, "idempotency: scope: %v", err)
		}
		return result{Result: Result{Outcome: OutcomeRejected}}, ResponseMetadata{}, err
	}
	fp, err := Fingerprint(call.Method, call.Request)
	if err != nil {
		return result{Result: Result{Outcome: OutcomeRejected}}, ResponseMetadata{}, status.Errorf(codes.InvalidArgument, "idempotency: %v", err)
	}
	ttl := s.o.ttl
	if p.pol.ttl > 0 {
		ttl = p.pol.ttl
	}
	c := Call{Scope: scope, Key: p.key, Method: call.Method, Fingerprint: fp, TTL: ttl, Retry: isRetryAttempt(call.Metadata), Isolation: p.pol.isolation}
	tp.responseType = p.pol.responseType
	tp.digest, tp.hasDigest = requestDigest(call.Request, s.store.opts.derivedKeyVersion), true
	var md ResponseMetadata
	tp.metadata = func() ([]byte, error) { return encodeResponseMetadata(md) }
	res, err := s.store.execute(ctx, c, tp, func(ctx context.Context, _ pgx.Tx) (proto.Message, error) {
		resp, m, err := handler(ctx)
		md = m
		if err != nil {
			err = handlerError(err)
			if s.o.final[status.Code(err)] {
				return nil, Final(err)
			}
			return nil, err
		}
		return resp, nil
	})
	return res, md, err
}

// RefuseStream is what a framework's adapter answers a streaming call of
// method with md, its metadata: nil when the call may go on unprotected,
// else [ErrStreamingUnsupported], as [StreamServerInterceptor] answers.
// Streaming calls are not protected: one whose method the
// (idempotency.v1.method) option annotates, or that carries a key, is
// refused before its handler runs. req, the stream's first request when
// the adapter has it (nil before), finds the descriptor of a method that
// is not in the global registry.
func (s *UnaryServer) RefuseStream(method string, md metadata.MD, req proto.Message) error {
	pol := policyForRequest(method, req)
	return refuseStream(md, method, pol)
}

package idempotency

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/exactlyonce/idempotency/internal/seam"
)

// unaryServer is the server side of the layer for the unary calls of any
// RPC framework: what [UnaryServerInterceptor] runs on for grpc-go, and
// what package unary lends the adapters of other frameworks
// (idempotencyconnect's for connect-go), so that every framework's calls
// are decided, keyed, fingerprinted, stored and replayed the same way: a
// key sent through one of them is the same call through any other on the
// same store and scope.
type unaryServer struct {
	store *Store
	o     serverOptions
}

var _ seam.Server = (*unaryServer)(nil)

func init() {
	seam.NewServer = func(store, opts any) (seam.Server, error) {
		o := defaultServerOptions()
		for _, opt := range opts.([]ServerOption) {
			opt(&o)
		}
		if err := o.validate(); err != nil {
			return nil, err
		}
		return &unaryServer{store: store.(*Store), o: o}, nil
	}
}

// Serve runs call through the idempotency layer: a call that needs no key
// runs handler as it is; a keyed call runs handler at most once per key in
// the call's transaction, and a retry gets the stored answer. The error is
// the status the client gets: the handler's own (with its code, message
// and details), or the idempotency layer's (see codes.go).
func (s *unaryServer) Serve(ctx context.Context, call seam.Call, handler seam.Handler) (seam.Reply, error) {
	p, err := s.prepare(ctx, call)
	if err == nil && p.passThrough {
		resp, md, err := handler(ctx)
		return seam.Reply{Response: resp, Metadata: md}, err
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
func (s *unaryServer) prepare(ctx context.Context, call seam.Call) (plan, error) {
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
func (s *unaryServer) protect(ctx context.Context, call seam.Call, p plan, err error, handler seam.Handler) (_ seam.Reply, err2 error) {
	traceKey := p.key
	if vals := call.Metadata.Get(MetadataKey); traceKey == "" && len(vals) > 0 {
		traceKey = vals[0]
	}
	kind := Transport(call.Transport)
	if kind == "" {
		kind = TransportGRPC
	}
	tp := &transport{kind: kind, finalCode: func(c codes.Code) bool { return s.o.final[c] }}
	outcome := OutcomeRejected
	if s.store.opts.tracer != nil {
		ctx, tp.trace = s.store.startTrace(ctx, TraceCallStartData{Transport: kind, Method: call.Method, Key: traceKey, Attempt: clientAttempt(call.Metadata)})
		defer tp.trace.endDeferred(ctx, &outcome, &err2)
	}
	if err != nil {
		return seam.Reply{Outcome: int(outcome)}, err
	}
	res, md, err := s.execute(ctx, tp, call, p, handler)
	outcome = res.Outcome
	reply := seam.Reply{Outcome: int(res.Outcome)}
	switch {
	case res.Outcome == OutcomeReplayed && (err == nil || IsFinal(err)):
		md, derr := decodeMD(res.metadata)
		if derr != nil {
			return reply, status.Errorf(codes.Internal, "idempotency: %v", derr)
		}
		md.Trailer = metadata.Join(md.Trailer, metadata.Pairs(ReplayedTrailer, "true"))
		reply.Metadata = md
	case res.ownAnswer:
		// This run's answer: its headers and trailers go with it. Any
		// other (a replay of another call's row, an error of the
		// engine's) is not this run's, and must not carry what its
		// rolled-back handler set.
		reply.Metadata = md
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
func (s *unaryServer) callKey(md metadata.MD, pol methodPolicy, req proto.Message) (string, error) {
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
func (s *unaryServer) execute(ctx context.Context, tp *transport, call seam.Call, p plan, handler seam.Handler) (result, seam.Metadata, error) {
	scope, err := s.o.scope(ctx)
	if err != nil {
		if _, ok := status.FromError(err); !ok {
			err = status.Errorf(codes.Internal, "idempotency: scope: %v", err)
		}
		return result{Result: Result{Outcome: OutcomeRejected}}, seam.Metadata{}, err
	}
	fp, err := Fingerprint(call.Method, call.Request)
	if err != nil {
		return result{Result: Result{Outcome: OutcomeRejected}}, seam.Metadata{}, status.Errorf(codes.InvalidArgument, "idempotency: %v", err)
	}
	ttl := s.o.ttl
	if p.pol.ttl > 0 {
		ttl = p.pol.ttl
	}
	c := Call{Scope: scope, Key: p.key, Method: call.Method, Fingerprint: fp, TTL: ttl, Retry: isRetryAttempt(call.Metadata), Isolation: p.pol.isolation}
	tp.responseType = p.pol.responseType
	tp.digest, tp.hasDigest = requestDigest(call.Request, s.store.opts.derivedKeyVersion), true
	var md seam.Metadata
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
func (s *unaryServer) RefuseStream(method string, md metadata.MD, req proto.Message) error {
	pol := policyForRequest(method, req)
	return refuseStream(md, method, pol)
}

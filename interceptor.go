package idempotency

import (
	"context"
	"fmt"
	"time"

	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/retry"
	"github.com/jackc/pgx/v5"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
)

// MetadataKey is the gRPC metadata key carrying the idempotency key.
const MetadataKey = "idempotency-key"

// ReplayedTrailer is the response trailer set to "true" when the response
// (or final error) was replayed from the store instead of executed: a
// client reads it with grpc.Trailer. A handler may not set it.
const ReplayedTrailer = "idempotency-replayed"

// UnaryServerInterceptor returns a server interceptor that runs each call
// carrying an idempotency key at most once, using store.
//
// A call with a valid key runs in a transaction that the handler reaches
// with [TxFromContext]; its writes, the claim of the key and the stored
// response commit together. Retries of a finished call get the stored
// response (or final error) with the trailer [ReplayedTrailer]; see
// [Store.Execute] for every outcome and codes.go for the status codes.
//
// Which calls need a key is decided per method, once, from the method's
// descriptor: the (idempotency.v1.method) option first (see
// proto/idempotency/v1/idempotency.proto), then protobuf's
// idempotency_level (NO_SIDE_EFFECTS and IDEMPOTENT calls pass through, any
// key ignored), then this interceptor's options: without
// [WithKeyRequired], calls without a key pass through unchanged.
//
// It protects unary calls only; install [StreamServerInterceptor] beside
// it, which refuses the streaming calls that ask for protection.
//
// It panics if store is nil or an option is invalid, as those are
// programming errors found at startup.
func UnaryServerInterceptor(store *Store, opts ...ServerOption) grpc.UnaryServerInterceptor {
	o := mustServerOptions("UnaryServerInterceptor", store, opts)
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (_ any, err error) {
		pol := policyForRequest(info.FullMethod, req)
		_, inCall := TxFromContext(ctx)
		if (pol.mode == modePassThrough && pol.err == nil) || inCall {
			// The interceptor chained twice protects a call once.
			return handler(ctx, req)
		}
		key, err := o.callKey(ctx, pol, req)
		if err == nil && key == "" {
			if pol.mode == modeOptional || (pol.mode == modeDefault && !o.requireKey) {
				return handler(ctx, req)
			}
			err = missingKey(pol)
		}
		traceKey := key
		if vals := metadata.ValueFromIncomingContext(ctx, MetadataKey); traceKey == "" && len(vals) > 0 {
			traceKey = vals[0]
		}
		tp := &transport{kind: TransportGRPC, finalCode: func(c codes.Code) bool { return o.final[c] }}
		outcome := OutcomeRejected
		if store.opts.tracer != nil {
			ctx, tp.trace = store.startCall(ctx, TransportGRPC, info.FullMethod, traceKey)
			defer tp.trace.endDeferred(ctx, &outcome, &err)
		}
		if err != nil {
			return nil, err
		}
		res, rec, err := o.serve(ctx, tp, store, key, pol, req, info, handler)
		outcome = res.Outcome
		switch {
		case res.Outcome == OutcomeReplayed && (err == nil || IsFinal(err)):
			if merr := replayMetadata(ctx, res.metadata); merr != nil {
				res.Response, err = nil, status.Errorf(codes.Internal, "%v", merr)
			}
		case rec != nil && res.ownAnswer:
			// This run's answer: its headers and trailers go with it. Any
			// other (a replay of another call's row, an error of the
			// engine's) is not this run's, and must not carry what its
			// rolled-back handler set.
			rec.flush()
		}
		err = unwrapFinal(err) // the client gets the status the handler returned
		if err != nil {
			return nil, err
		}
		return exactResponse(res), nil
	}
}

// ServerOption configures [UnaryServerInterceptor]. An invalid value makes
// UnaryServerInterceptor panic, naming the option.
type ServerOption func(*serverOptions)

type serverOptions struct {
	scope      func(context.Context) (string, error)
	requireKey bool
	ttl        time.Duration
	final      map[codes.Code]bool
	err        error // the first invalid option
}

func defaultServerOptions() serverOptions {
	return serverOptions{
		scope: func(context.Context) (string, error) { return "", nil },
		ttl:   DefaultTTL,
		final: codeSet(DefaultFinalCodes()),
	}
}

// mustServerOptions applies opts for the constructor named who, panicking
// on a nil store or an invalid option.
func mustServerOptions(who string, store *Store, opts []ServerOption) serverOptions {
	if store == nil {
		panic("idempotency: " + who + ": store is nil")
	}
	o := defaultServerOptions()
	for _, opt := range opts {
		opt(&o)
	}
	if err := o.validate(); err != nil {
		panic(err.Error())
	}
	return o
}

func (o *serverOptions) validate() error {
	switch {
	case o.err != nil:
		return o.err
	case o.scope == nil:
		return fmt.Errorf("idempotency: WithScope: function is nil")
	case o.ttl <= 0:
		return fmt.Errorf("idempotency: WithTTL: must be positive, got %v", o.ttl)
	}
	return nil
}

// DefaultFinalCodes returns the handler error codes that are final by
// default: they mean the request was decided and repeating it gives the
// same answer, so they are stored and replayed: NotFound, AlreadyExists,
// PermissionDenied, FailedPrecondition and OutOfRange.
//
// Every other code releases the key so a retry runs the handler again:
// the transient ones (Unavailable, Aborted, DeadlineExceeded, ...), the
// two that say the request was never processed, InvalidArgument (it failed
// validation) and Unauthenticated, so that the corrected request can be
// sent with the same key, and Unimplemented: during a rolling deploy a
// replica may have a method's stub before its implementation, and the
// retry may reach one that has both.
func DefaultFinalCodes() []codes.Code {
	return []codes.Code{
		codes.NotFound, codes.AlreadyExists, codes.PermissionDenied,
		codes.FailedPrecondition, codes.OutOfRange,
	}
}

func codeSet(cs []codes.Code) map[codes.Code]bool {
	set := make(map[codes.Code]bool, len(cs))
	for _, c := range cs {
		set[c] = true
	}
	return set
}

// WithScope sets the function that names the caller's key scope, usually
// from the authenticated identity an earlier interceptor put in ctx. Keys
// are unique per scope, so two callers can use the same key without seeing
// each other's results. An error from the function rejects the call; return
// a status error (e.g. codes.Unauthenticated) to choose its code, other
// errors become codes.Internal.
//
// Defaults to one scope ("") shared by every caller. That is only safe when
// all callers trust each other: a caller who learns another caller's key
// and request body can read that call's stored response.
func WithScope(f func(ctx context.Context) (string, error)) ServerOption {
	return func(o *serverOptions) { o.scope = f }
}

// WithKeyRequired makes calls without an idempotency key fail with
// codes.InvalidArgument ([ErrMissingKey]) instead of passing through, for
// methods whose descriptor does not decide (the (idempotency.v1.method)
// option's mode decides for the methods it annotates). Without it, the
// default, such calls pass through unprotected, so that a service can take
// keys method by method; the HTTP middleware's default is the other way
// round (see [WithHTTPKeyOptional]), as it protects only the methods it is
// told to.
func WithKeyRequired() ServerOption {
	return func(o *serverOptions) { o.requireKey = true }
}

// WithTTL sets how long finished keys are kept; a retry after that runs the
// call again. Must be positive. Defaults to 24 hours ([DefaultTTL]).
func WithTTL(ttl time.Duration) ServerOption {
	return func(o *serverOptions) { o.ttl = ttl }
}

// WithFinalCodes replaces the set of handler error codes that are final:
// stored and replayed like responses (their business writes still roll
// back). Errors with other codes release the key. codes.OK is not an error
// code and is refused. Use with care: making a transient code such as
// Unavailable final makes the failure permanent for that key. Defaults to
// [DefaultFinalCodes].
func WithFinalCodes(cs ...codes.Code) ServerOption {
	return func(o *serverOptions) {
		for _, c := range cs {
			if c == codes.OK || c > codes.Unauthenticated {
				o.err = fmt.Errorf("idempotency: WithFinalCodes: %v is not an error code", c)
				return
			}
		}
		o.final = codeSet(cs)
	}
}

// callKey returns the key of a call: from the metadata, else from the
// method's key field; "" when it has none.
func (o *serverOptions) callKey(ctx context.Context, pol methodPolicy, req any) (string, error) {
	if pol.err != nil {
		return "", status.Errorf(codes.Internal, "idempotency: misconfigured: %v", pol.err)
	}
	key, ok, err := keyFromIncoming(ctx)
	if err != nil || ok || pol.keyField == nil {
		return key, err
	}
	msg, isProto := req.(proto.Message)
	if !isProto {
		return "", status.Errorf(codes.Internal, "idempotency: request is %T, not a proto message", req)
	}
	key = pol.keyFromField(msg)
	if key == "" {
		return "", invalidKey(pol.keyPath, fmt.Sprintf("request field %s is empty and the call has no %s metadata", pol.keyPath, MetadataKey))
	}
	if err := ValidateKey(key); err != nil {
		return "", keyError(err, pol.keyPath, "request field "+pol.keyPath)
	}
	return key, nil
}

func (o *serverOptions) serve(ctx context.Context, tp *transport, store *Store, key string, pol methodPolicy, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (result, *recordingStream, error) {
	rejected := result{Result: Result{Outcome: OutcomeRejected}}
	msg, ok := req.(proto.Message)
	if !ok {
		return rejected, nil, status.Errorf(codes.Internal, "idempotency: request of %s is %T, not a proto message", info.FullMethod, req)
	}
	scope, err := o.scope(ctx)
	if err != nil {
		if _, ok := status.FromError(err); !ok {
			err = status.Errorf(codes.Internal, "idempotency: scope: %v", err)
		}
		return rejected, nil, err
	}
	fp, err := Fingerprint(info.FullMethod, msg)
	if err != nil {
		return rejected, nil, status.Errorf(codes.InvalidArgument, "idempotency: %v", err)
	}
	ttl := o.ttl
	if pol.ttl > 0 {
		ttl = pol.ttl
	}
	call := Call{Scope: scope, Key: key, Method: info.FullMethod, Fingerprint: fp, TTL: ttl, Retry: isRetryAttempt(ctx), Isolation: pol.isolation}
	tp.responseType = pol.responseType
	tp.digest, tp.hasDigest = requestDigest(msg), true
	ctx, rec := recordMetadata(ctx)
	if rec != nil {
		tp.metadata = rec.encode
	}
	res, err := store.execute(ctx, call, tp, func(ctx context.Context, _ pgx.Tx) (proto.Message, error) {
		if rec != nil {
			rec.reset()
		}
		resp, err := handler(ctx, req)
		if err != nil {
			err = handlerError(err)
			if o.final[status.Code(err)] {
				return nil, Final(err)
			}
			return nil, err
		}
		m, ok := resp.(proto.Message)
		if !ok {
			return nil, status.Errorf(codes.Internal, "idempotency: response of %s is %T, not a proto message", info.FullMethod, resp)
		}
		return m, nil
	})
	return res, rec, err
}

// grpcPreviousAttempts is the metadata gRPC's own retry policy adds to a
// retry attempt.
const grpcPreviousAttempts = "grpc-previous-rpc-attempts"

// retryMarkers are the metadata that retry interceptors add to a retry
// attempt: go-grpc-middleware v2's, and v1's, which many copies of it keep.
// A retry loop that adds none cannot be told from a new call.
var retryMarkers = []string{retry.AttemptMetadataKey, "x-retry-attempty"}

// isRetryAttempt reports whether the client marked the call as a retry, so
// the engine looks for a stored result before anything else.
func isRetryAttempt(ctx context.Context) bool {
	md, _ := metadata.FromIncomingContext(ctx)
	return len(md.Get(grpcPreviousAttempts)) > 0 || isMarkedRetry(md)
}

// isMarkedRetry reports whether md carries a retry interceptor's marker.
func isMarkedRetry(md metadata.MD) bool {
	for _, k := range retryMarkers {
		if len(md.Get(k)) > 0 {
			return true
		}
	}
	return false
}

// binaryMetadataKey is the binary form of [MetadataKey]. To gRPC it is
// another header, so a call carrying it is refused wherever it is seen
// (client and server, beside a text key or not): ignoring it would leave
// the call unprotected, and honouring it beside a text key would leave two
// keys for one call.
const binaryMetadataKey = MetadataKey + "-bin"

func binaryKey() error {
	return invalidKey(binaryMetadataKey, fmt.Sprintf("the key was sent as binary metadata %s; send it as the text metadata %s", binaryMetadataKey, MetadataKey))
}

// missingKey is ErrMissingKey naming where the key is expected.
func missingKey(pol methodPolicy) error {
	if pol.keyField != nil {
		return ErrMissingKey.with(fmt.Sprintf("send it in the %s metadata or the request field %s", MetadataKey, pol.keyPath), nil).about(pol.keyPath)
	}
	return ErrMissingKey.with(fmt.Sprintf("send it in the %s metadata", MetadataKey), nil).about(MetadataKey)
}

// keyFromIncoming returns the key of an incoming call. ok is false when the
// call has none; more than one value, or an invalid one, is an error.
func keyFromIncoming(ctx context.Context) (key string, ok bool, err error) {
	if len(metadata.ValueFromIncomingContext(ctx, binaryMetadataKey)) > 0 {
		return "", false, binaryKey()
	}
	vals := metadata.ValueFromIncomingContext(ctx, MetadataKey)
	switch len(vals) {
	case 0:
		return "", false, nil
	case 1:
		if err := ValidateKey(vals[0]); err != nil {
			return "", false, keyError(err, MetadataKey, "")
		}
		return vals[0], true, nil
	default:
		return "", false, invalidKey(MetadataKey, fmt.Sprintf("%d values sent, exactly one is allowed", len(vals)))
	}
}

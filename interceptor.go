package idempotency

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
)

const (
	// MetadataKey is the gRPC metadata key carrying the idempotency key.
	MetadataKey = "idempotency-key"
	// ReplayedTrailer is the response trailer set to "true" when the
	// response was replayed from the store instead of executed.
	ReplayedTrailer = "idempotency-replayed"
)

// UnaryServerInterceptor returns a server interceptor that runs each call
// carrying an idempotency key at most once, using store.
//
// A call with a valid key runs in a transaction that the handler reaches
// with [TxFromContext]; its writes, the claim of the key and the stored
// response commit together. Retries of a finished call get the stored
// response (or decided error) with the trailer [ReplayedTrailer]; see
// [Store.Execute] for every outcome and codes.go for the status codes.
//
// Which calls need a key is decided per method, once, from the method's
// descriptor: the (idempotency.v1.method) option first (see
// proto/idempotency/v1/idempotency.proto), then protobuf's
// idempotency_level (NO_SIDE_EFFECTS and IDEMPOTENT calls pass through, any
// key ignored), then this interceptor's options: without
// [WithKeyRequired], calls without a key pass through unchanged.
//
// It panics if store is nil or an option is invalid, as those are
// programming errors found at startup.
func UnaryServerInterceptor(store *Store, opts ...Option) grpc.UnaryServerInterceptor {
	if store == nil {
		panic("idempotency: UnaryServerInterceptor: store is nil")
	}
	o := evaluateOptions(opts)
	if o.ttl <= 0 {
		panic(fmt.Sprintf("idempotency: WithTTL: must be positive, got %v", o.ttl))
	}
	if o.scope == nil {
		panic("idempotency: WithScope: function is nil")
	}
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		pol := policyFor(info.FullMethod)
		if pol.mode == modePassThrough && pol.err == nil {
			return handler(ctx, req)
		}
		key, err := o.callKey(ctx, pol, req)
		if err == nil && key == "" {
			if pol.mode == modeOptional || (pol.mode == modeDefault && !o.requireKey) {
				return handler(ctx, req)
			}
			err = missingKey()
		}
		if err != nil {
			o.report(ctx, info.FullMethod, OutcomeRejected, err)
			return nil, err
		}
		ttl := o.ttl
		if pol.ttl > 0 {
			ttl = pol.ttl
		}
		res, err := o.serve(ctx, store, key, ttl, req, info, handler)
		if res.Outcome == OutcomeReplayed && (err == nil || IsFinal(err)) {
			// Best effort: fails only if the stream is already done.
			_ = grpc.SetTrailer(ctx, metadata.Pairs(ReplayedTrailer, "true"))
		}
		err = unwrapFinal(err) // the client gets the status the handler returned
		o.report(ctx, info.FullMethod, res.Outcome, err)
		if err != nil {
			return nil, err
		}
		return res.Response, nil
	}
}

// callKey returns the key of a call: from the metadata, else from the
// method's key field; "" when it has none.
func (o *options) callKey(ctx context.Context, pol methodPolicy, req any) (string, error) {
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
		return "", invalidKeyField(pol.keyPath, fmt.Sprintf("request field %s is empty and the call has no %s metadata", pol.keyPath, MetadataKey))
	}
	if err := ValidateKey(key); err != nil {
		var e *Error
		errors.As(err, &e)
		return "", invalidKeyField(pol.keyPath, "request field "+pol.keyPath+": "+e.detail)
	}
	return key, nil
}

func (o *options) serve(ctx context.Context, store *Store, key string, ttl time.Duration, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (Result, error) {
	msg, ok := req.(proto.Message)
	if !ok {
		return Result{Outcome: OutcomeRejected}, status.Errorf(codes.Internal, "idempotency: request of %s is %T, not a proto message", info.FullMethod, req)
	}
	scope, err := o.scope(ctx)
	if err != nil {
		if _, ok := status.FromError(err); !ok {
			err = status.Errorf(codes.Internal, "idempotency: scope: %v", err)
		}
		return Result{Outcome: OutcomeRejected}, err
	}
	fp, err := Fingerprint(info.FullMethod, msg)
	if err != nil {
		return Result{Outcome: OutcomeRejected}, status.Errorf(codes.InvalidArgument, "idempotency: %v", err)
	}
	call := Call{Scope: scope, Key: key, Method: info.FullMethod, Fingerprint: fp, TTL: ttl}
	return store.Execute(ctx, call, func(ctx context.Context, _ pgx.Tx) (proto.Message, error) {
		resp, err := handler(ctx, req)
		if err != nil {
			if o.decided[status.Code(err)] {
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
}

func (o *options) report(ctx context.Context, method string, outcome Outcome, err error) {
	if o.onOutcome != nil {
		o.onOutcome(ctx, method, outcome, err)
	}
}

// keyFromIncoming returns the key of an incoming call. ok is false when the
// call has none; more than one value, or an invalid one, is an error.
func keyFromIncoming(ctx context.Context) (key string, ok bool, err error) {
	vals := metadata.ValueFromIncomingContext(ctx, MetadataKey)
	switch len(vals) {
	case 0:
		return "", false, nil
	case 1:
		if err := ValidateKey(vals[0]); err != nil {
			return "", false, err
		}
		return vals[0], true, nil
	default:
		return "", false, invalidKey(fmt.Sprintf("%d values sent, exactly one is allowed", len(vals)))
	}
}

func missingKey() error {
	e := ErrMissingKey.with("", nil)
	e.violation = MetadataKey
	return e
}

// Fingerprint identifies a request for key-reuse checks: SHA-256 over the
// full method name and the deterministic protobuf encoding of req.
func Fingerprint(fullMethod string, req proto.Message) ([]byte, error) {
	b, err := proto.MarshalOptions{Deterministic: true}.Marshal(req)
	if err != nil {
		return nil, errors.Join(errors.New("fingerprint request"), err)
	}
	h := sha256.New()
	h.Write([]byte(fullMethod))
	h.Write([]byte{0})
	h.Write(b)
	return h.Sum(nil), nil
}

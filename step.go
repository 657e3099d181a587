package idempotency

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc/codes"
	grpcstatus "google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// namespaceStep is the namespace of steps' records in the key table (see
// Step): "step " and the step's key. No client's key has a space, nor does
// a derived key, so no call's key is ever a step's.
const namespaceStep = "step "

// ErrStepOutsideCall is returned by [Step] called with a context that no
// running call is in: a step's record belongs to the call it runs in, and
// nothing would tell a re-run that the step had run. It is a programming
// error: retrying cannot help.
var ErrStepOutsideCall = &Error{code: codes.Internal, reason: "STEP_OUTSIDE_CALL",
	msg: "idempotency.Step was called outside a running call; call it with the context the handler was given"}

// ErrStepChanged is returned by [Step] when the outcome recorded for the
// step is not one the handler can take: it asks for another result type
// than the step recorded (the handler's code changed between a run and its
// re-run). Nothing is sent: the recorded outcome stands, and only an
// operator can decide what to do with it (see Store.Inspect).
var ErrStepChanged = &Error{code: codes.Internal, reason: "STEP_CHANGED",
	msg: "the step's recorded outcome does not fit what the handler asks for now"}

// Step runs fn, a piece of work that calls another system, once for the
// call running in ctx, and records its outcome under the step's name.
// Before running fn it looks for that outcome: a re-run of the call (after
// a crash, or a retry of a call that failed after the step) gets the
// recorded response, or the recorded final error, and fn is not called,
// whatever the other system still remembers of the key.
//
// fn gets the step's key, [EffectKey] of name (the same on every run of
// the same operation; send it to the other system as its idempotency key),
// and a context naming the effect ([WithEffect]), so that [HTTPClient],
// [HTTPTransport] and the gRPC client chain send that key too. Its outcome
// is recorded in a row of its own, committed at once on another connection
// of the store's pool (so a pool of one cannot run a step), outside the
// call's transaction: it survives the call's rollback and a crash of the
// process. The record lives as long as a key's (the call's TTL; the
// cleaner deletes both), and [Store.Inspect] lists it with the call's key.
//
// A response is recorded, and so is an error marked [Final]; any other
// error is returned as is and recorded nowhere, so that a re-run runs the
// step again with the same key. Two runs of one step at once (goroutines of
// one call with the same name) both run fn, and both get the outcome
// recorded first. Steps of other names are independent.
//
// What is left is a crash between the other system's answer and the
// record's commit: the re-run sends the same key again, and is charged
// once only if the other system still knows that key. That window is one
// local commit long, not the other system's memory of keys.
//
// A recorded response of another type than T is [ErrStepChanged]. Name
// each step after what it does, such as "charge " + orderID, and keep the
// name for that effect on every run.
func Step[T proto.Message](ctx context.Context, name string, fn func(ctx context.Context, key string) (T, error)) (T, error) {
	var zero T
	t, ok := callFrom(ctx)
	switch {
	case any(zero) == nil:
		return zero, errStepType
	case !ok:
		return zero, ErrStepOutsideCall.with("step "+name, nil)
	case t.ended():
		return zero, ErrCallEnded.with("step "+name, nil)
	case name == "":
		return zero, ErrUnnamedEffect.with("a step", nil)
	}
	a := t.attempt
	return runStep(ctx, a.s, a.st, a.call.Scope, t.effectKey(name), a.key, name, a.call.TTL, fn)
}

// KeyedStep is [Step] for work that runs outside any idempotent call but
// has a key of its own: a job of a queue that calls another system with
// the key the job carries, say. The outcome is recorded under scope and
// key (the same record as [Step]'s when key is the [EffectKey] a call
// derived for that step, so that a charge made inline by one run of a call
// and by a job for another run is one step), for ttl (DefaultTTL when
// zero), and fn gets key. The key must be valid ([ValidateKey]).
func KeyedStep[T proto.Message](ctx context.Context, s *Store, scope, key string, ttl time.Duration, fn func(ctx context.Context, key string) (T, error)) (T, error) {
	var zero T
	if any(zero) == nil {
		return zero, errStepType
	}
	if err := ValidateKey(key); err != nil {
		return zero, err
	}
	if err := ValidateScope(scope); err != nil {
		return zero, err
	}
	if ttl <= 0 {
		ttl = DefaultTTL
	}
	st, err := s.statements(ctx)
	if err != nil {
		return zero, s.dbError(ctx, "step", err)
	}
	return runStep(ctx, s, st, scope, key, "", key, ttl, func(ctx context.Context, key string) (T, error) { return fn(ctx, key) })
}

var errStepType = errors.New("idempotency: a step's result type must be a message type, such as *examplev1.Charge, not proto.Message")

// runStep runs the step of key (see Step) in scope, recorded with the key
// of the call it belongs to (parent, "" for none) and its name.
func runStep[T proto.Message](ctx context.Context, s *Store, st *statements, scope, key, parent, name string, ttl time.Duration,
	fn func(ctx context.Context, key string) (T, error)) (T, error) {
	var zero T
	var ran T
	rec, err := s.step(ctx, st, scope, key, parent, name, ttl, func(ctx context.Context, key string) (proto.Message, error) {
		var err error
		ran, err = fn(ctx, key)
		return ran, err
	})
	if rec == nil {
		if err != nil {
			return ran, err // fn's own error, which is not recorded
		}
		return zero, err
	}
	if err != nil {
		return zero, err
	}
	return replayStep[T](name, rec)
}

// step is runStep without its result's type: the step's record, looked up
// or made by running fn. An error of fn that is not final comes back with
// a nil record, and is recorded nowhere.
func (s *Store) step(ctx context.Context, st *statements, scope, key, parent, name string, ttl time.Duration,
	fn func(ctx context.Context, key string) (proto.Message, error)) (*record, error) {
	rec, err := s.lookupStep(ctx, st, scope, key)
	if err != nil || rec != nil {
		return rec, err
	}
	v, err := fn(WithEffect(ctx, name), key)
	if err != nil && !IsFinal(err) {
		return nil, err
	}
	row := keyRow{scope: scope, key: namespaceStep + key, method: name, fingerprint: []byte{}, state: "succeeded", ttl: ttl, metadata: []byte(parent)}
	return s.recordStep(ctx, st, &row, v, err)
}

// stepInto is Step for a transport's client, whose result is dst (a gRPC
// call's reply): fn fills dst, and a recorded response is decoded into it.
func stepInto(ctx context.Context, t *callTx, name string, dst proto.Message, fn func(ctx context.Context, key string) error) error {
	a := t.attempt
	rec, err := a.s.step(ctx, a.st, a.call.Scope, t.effectKey(name), a.key, name, a.call.TTL, func(ctx context.Context, key string) (proto.Message, error) {
		return dst, fn(ctx, key)
	})
	if rec == nil || err != nil {
		return err
	}
	if rec.state == "failed" {
		_, err := replayStep[*wrapperspb.BytesValue](name, rec)
		return err
	}
	got := ""
	if rec.responseType != nil {
		got = *rec.responseType
	}
	if want := string(dst.ProtoReflect().Descriptor().FullName()); got != want {
		return ErrStepChanged.with(fmt.Sprintf("step %q recorded a %s, and the call's reply is a %s", name, got, want), nil)
	}
	proto.Reset(dst)
	if err := proto.Unmarshal(rec.response, dst); err != nil {
		return grpcstatus.Errorf(codes.Internal, "idempotency: stored response of step %q: %v", name, err)
	}
	return nil
}

// lookupStep returns the live record of the step of key, nil when there
// is none.
func (s *Store) lookupStep(ctx context.Context, st *statements, scope, key string) (*record, error) {
	rec, err := scanRecord(s.db.QueryRow(ctx, st.lookup, scope, namespaceStep+key))
	if err != nil {
		return nil, s.dbError(ctx, "look up step", err)
	}
	if rec != nil && rec.expired {
		return nil, nil
	}
	return rec, nil
}

// recordStep records row, the outcome of a step that ran (v, or the final
// error ferr), in a transaction of its own, and returns the step's record:
// its own, or the one another run of the step recorded first.
func (s *Store) recordStep(ctx context.Context, st *statements, row *keyRow, v proto.Message, ferr error) (*record, error) {
	if ferr != nil {
		b, err := marshalStatus(finalStatus(ferr))
		if err != nil {
			return nil, fmt.Errorf("idempotency: step %q: marshal status: %w", row.method, err)
		}
		row.state, row.status = "failed", b
	} else if v.ProtoReflect().IsValid() {
		b, err := proto.MarshalOptions{Deterministic: true}.Marshal(v)
		if err != nil {
			return nil, fmt.Errorf("idempotency: step %q: marshal response: %w", row.method, err)
		}
		row.responseType, row.response = string(v.ProtoReflect().Descriptor().FullName()), b
	}
	var recorded bool
	switch err := s.db.QueryRow(ctx, st.recordStep, row.args()...).Scan(&recorded); {
	case err == nil:
		rt := row.responseType
		return &record{method: row.method, state: row.state, responseType: &rt, response: row.response, status: row.status}, nil
	case !errors.Is(err, pgx.ErrNoRows):
		return nil, s.dbError(ctx, "record step", err)
	}
	// Another run of the step recorded first: its outcome is the step's.
	rec, err := s.lookupStep(ctx, st, row.scope, strings.TrimPrefix(row.key, namespaceStep))
	if err == nil && rec == nil {
		err = s.dbError(ctx, "record step", errors.New("the step's record is not there after its commit"))
	}
	return rec, err
}

// replayStep returns the outcome rec records for the step name, as T.
func replayStep[T proto.Message](name string, rec *record) (T, error) {
	var zero T
	if rec.state == "failed" {
		st := &status.Status{}
		if err := proto.Unmarshal(rec.status, st); err != nil {
			return zero, grpcstatus.Errorf(codes.Internal, "idempotency: stored status of step %q: %v", name, err)
		}
		return zero, storedFinal(grpcstatus.FromProto(st))
	}
	want := zero.ProtoReflect().Descriptor().FullName()
	got := protoreflect.FullName("")
	if rec.responseType != nil {
		got = protoreflect.FullName(*rec.responseType)
	}
	if got == "" {
		// fn returned a nil message.
		return zero, nil
	}
	if got != want {
		return zero, ErrStepChanged.with(fmt.Sprintf("step %q recorded a %s, and the handler asks for a %s", name, got, want), nil)
	}
	m := zero.ProtoReflect().Type().New().Interface()
	if err := proto.Unmarshal(rec.response, m); err != nil {
		return zero, grpcstatus.Errorf(codes.Internal, "idempotency: stored response of step %q: %v", name, err)
	}
	return m.(T), nil
}

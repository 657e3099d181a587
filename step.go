package idempotency

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"net/http"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc/codes"
	grpcstatus "google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"
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

// ErrStepPool is returned by [Step] on a store whose pool cannot hold two
// connections: a step holds one of its own while the call holds another.
// It is a configuration error: raise the pool's MaxConns.
var ErrStepPool = &Error{code: codes.Internal, reason: "STEP_POOL",
	msg: "a step needs a second connection of the store's pool; raise the pool's MaxConns"}

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
// is recorded in a row of its own, in a transaction of its own (see below)
// that commits as soon as fn returns, outside the call's transaction: it
// survives the call's rollback and a crash of the process. The record
// lives as long as a key's (the call's TTL; the cleaner deletes both),
// [Store.Inspect] lists it with the call's key, and [Store.Forget] of the
// call's key deletes it.
//
// A response is recorded, and so is an error marked [Final]; any other
// error is returned as is and recorded nowhere, so that a re-run runs the
// step again with the same key. A run of the same step at once (a
// goroutine of the call with the same name, or a run of the call that
// outlived it) waits for the first to record, and gets its outcome: fn
// runs once. Steps of other names are independent.
//
// The step holds a connection of its own from the store's pool, in a
// transaction, from its lookup to its record, fn's work included: size the
// pool for two connections per call that runs a step at once. A pool of
// one connection is refused with [ErrStepPool]; a step that gets no
// connection within the store's finish timeout fails with
// [ErrStoreUnavailable] before sending anything.
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
//
// The step holds a connection of its own from the store's pool (the call
// holds another), in a READ COMMITTED transaction that takes the step's
// lock, looks for its record, and, when there is none, stays open while fn
// runs, then writes the record and commits, which releases the lock: a run
// of the same step at once (a goroutine of the call, a run of the call
// that outlived it on another process) waits for the lock and finds the
// record, so fn runs once. A crash while fn runs ends the transaction, and
// with it the lock: what is left is a crash between fn's answer and that
// commit, after which the next run sends the same key again.
func (s *Store) step(ctx context.Context, st *statements, scope, key, parent, name string, ttl time.Duration,
	fn func(ctx context.Context, key string) (proto.Message, error)) (*record, error) {
	if p, ok := s.db.(*pgxpool.Pool); ok && p.Stat().MaxConns() < 2 {
		return nil, ErrStepPool.with(fmt.Sprintf("step %q: the store's pool has %d connection", name, p.Stat().MaxConns()), nil)
	}
	actx, cancel := context.WithTimeout(ctx, s.opts.finishTimeout)
	pc, err := s.db.Acquire(actx)
	cancel()
	if err != nil {
		if ctx.Err() == nil && errors.Is(err, context.DeadlineExceeded) {
			return nil, ErrStoreUnavailable.with(fmt.Sprintf("step %q: no connection of the store's pool was free for %v; nothing was sent. "+
				"A call that runs a step holds two connections: size the pool for the calls that run steps at once", name, s.opts.finishTimeout), err)
		}
		return nil, s.dbError(ctx, "step "+name, err)
	}
	defer pc.Release() // a connection still in a transaction is closed by the pool
	conn := pc.Conn()
	stored := namespaceStep + key
	b := &pgx.Batch{}
	b.Queue("BEGIN ISOLATION LEVEL READ COMMITTED READ WRITE")
	b.Queue(st.stepLock, scope, stored)
	b.Queue(st.lookup, scope, stored)
	br := conn.SendBatch(ctx, b)
	_, err = br.Exec()
	if err == nil {
		_, err = br.Exec()
	}
	var rec *record
	if err == nil {
		rec, err = scanRecord(br.QueryRow())
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		s.endStep(ctx, conn)
		return nil, s.dbError(ctx, "step "+name, err)
	}
	if rec != nil && !rec.expired {
		s.endStep(ctx, conn)
		return rec, nil
	}
	v, err := fn(WithEffect(ctx, name), key)
	if err != nil && !IsFinal(err) {
		s.endStep(ctx, conn)
		return nil, err
	}
	row := keyRow{scope: scope, key: stored, method: name, fingerprint: []byte{}, state: "succeeded", ttl: ttl, metadata: []byte(parent)}
	return s.recordStep(ctx, conn, st, &row, v, err)
}

// endStep ends a step's transaction that records nothing.
func (s *Store) endStep(ctx context.Context, conn *pgx.Conn) {
	if conn.PgConn().TxStatus() != 'I' {
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), s.opts.finishTimeout)
		defer cancel()
		if _, err := conn.Exec(rctx, "ROLLBACK"); err != nil {
			_ = conn.Close(rctx)
		}
	}
}

// recordStep writes row, the outcome of a step that ran (v, or the final
// error ferr), in the step's transaction on conn, and commits it.
func (s *Store) recordStep(ctx context.Context, conn *pgx.Conn, st *statements, row *keyRow, v proto.Message, ferr error) (*record, error) {
	// Whatever happens to the caller from here (it leaves, its deadline
	// passes), the other system has answered: the answer is recorded on a
	// context of its own, as a call's result is (WithFinishTimeout).
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), s.opts.finishTimeout)
	defer cancel()
	if ferr != nil {
		b, err := marshalStatus(finalStatus(ferr))
		if err != nil {
			s.endStep(ctx, conn)
			return nil, fmt.Errorf("idempotency: step %q: marshal status: %w", row.method, err)
		}
		row.state, row.status = "failed", b
	} else if v.ProtoReflect().IsValid() {
		b, err := proto.MarshalOptions{Deterministic: true}.Marshal(v)
		if err != nil {
			s.endStep(ctx, conn)
			return nil, fmt.Errorf("idempotency: step %q: marshal response: %w", row.method, err)
		}
		row.responseType, row.response = string(v.ProtoReflect().Descriptor().FullName()), b
	}
	// The step's answer is what its row holds once written: the record
	// is read back before the COMMIT, in the same round trip.
	b := &pgx.Batch{}
	b.Queue(st.recordStep, row.args()...)
	b.Queue(st.lookup, row.scope, row.key)
	b.Queue("COMMIT")
	br := conn.SendBatch(ctx, b)
	_, err := br.Exec()
	var rec *record
	if err == nil {
		rec, err = scanRecord(br.QueryRow())
	}
	if err == nil {
		_, err = br.Exec()
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	if err == nil && rec == nil {
		err = errors.New("the step's record is not there after it was written")
	}
	if err != nil {
		s.endStep(ctx, conn)
		return nil, s.finishError("record step "+row.method, err)
	}
	return rec, nil
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
	if ok, err := decodeStep(name, rec, dst); err != nil || ok {
		return err
	}
	return ErrStepChanged.with(fmt.Sprintf("step %q recorded no reply", name), nil)
}

// replayStep returns the outcome rec records for the step name, as T.
func replayStep[T proto.Message](name string, rec *record) (T, error) {
	var zero T
	m := zero.ProtoReflect().Type().New().Interface()
	if ok, err := decodeStep(name, rec, m); err != nil || !ok {
		return zero, err // a final error, or a nil message that fn returned
	}
	return m.(T), nil
}

// decodeStep decodes the outcome rec records for the step name into dst:
// its final error, or its response (ok: there is one; fn may have returned
// a nil message). A response of another type than dst's is ErrStepChanged.
func decodeStep(name string, rec *record, dst proto.Message) (ok bool, err error) {
	if rec.state == "failed" {
		st := &status.Status{}
		if err := proto.Unmarshal(rec.status, st); err != nil {
			return false, grpcstatus.Errorf(codes.Internal, "idempotency: stored status of step %q: %v", name, err)
		}
		return false, storedFinal(grpcstatus.FromProto(st))
	}
	got := protoreflect.FullName("")
	if rec.responseType != nil {
		got = protoreflect.FullName(*rec.responseType)
	}
	if got == "" {
		return false, nil
	}
	if want := dst.ProtoReflect().Descriptor().FullName(); got != want {
		return false, ErrStepChanged.with(fmt.Sprintf("step %q recorded a %s, and the handler asks for a %s", name, got, want), nil)
	}
	proto.Reset(dst)
	if err := proto.Unmarshal(rec.response, dst); err != nil {
		return false, grpcstatus.Errorf(codes.Internal, "idempotency: stored response of step %q: %v", name, err)
	}
	return true, nil
}

// recordedEffect is the running call in ctx and the effect ctx names, for
// an outgoing call whose key is derived from that name (ok): the calls a
// transport's client records as steps (WithRecordedEffects, RecordEffects).
func recordedEffect(ctx context.Context) (t *callTx, name string, ok bool) {
	name, _ = ctx.Value(effectName{}).(string)
	_, explicit := ctx.Value(outgoingKey{}).(string)
	t, live := liveCall(ctx)
	return t, name, name != "" && !explicit && live
}

// httpStep returns the recorded step of the HTTP request req, whose effect
// is named in its context, when recording it applies (the request's key is
// derived from that name, inside a running call), and nil otherwise: send
// then sends it as without recording. A response with a status another
// attempt may change (5xx, 408, 409, 425, 429) or that redirects (3xx;
// nor is the request of a redirect recorded) is returned unrecorded, as is
// an error of send; any other (2xx, 4xx) is recorded, its status, headers
// and body, and a re-run gets a copy of it without sending.
func httpStep(req *http.Request, send func(*http.Request) (*http.Response, error)) (resp *http.Response, recorded bool, err error) {
	ctx := req.Context()
	t, name, ok := recordedEffect(ctx)
	if _, redirect := redirectedKey(req); redirect || !ok || req.Header.Get(HeaderKey) != "" || !keyedMethod(req.Method) {
		return nil, false, nil
	}
	dst := &wrapperspb.BytesValue{}
	a := t.attempt
	key := t.effectKey(name)
	var unrecorded *http.Response
	sent := false
	defer func() {
		if !sent {
			closeBody(req) // a RoundTripper closes the request's body, sent or not
		}
	}()
	rec, err := a.s.step(ctx, a.st, a.call.Scope, key, a.key, name, a.call.TTL, func(context.Context, string) (proto.Message, error) {
		sent = true
		resp, err := send(req)
		if err != nil {
			return nil, err
		}
		if !recordedStatus(resp.StatusCode) {
			unrecorded = resp
			return nil, errUnrecorded
		}
		body, err := io.ReadAll(resp.Body)
		_ = resp.Body.Close()
		if err != nil {
			return nil, fmt.Errorf("idempotency: read the response of step %q to record it: %w", name, err)
		}
		dst.Value = encodeHTTPStep(resp, body)
		return dst, nil
	})
	switch {
	case unrecorded != nil:
		return unrecorded, true, nil
	case err != nil:
		return nil, true, err
	}
	if ok, err := decodeStep(name, rec, dst); err != nil || !ok {
		return nil, true, cmp.Or(err, error(ErrStepChanged.with(fmt.Sprintf("step %q did not record an HTTP response", name), nil)))
	}
	asSent := req.Clone(ctx)
	asSent.Header.Set(HeaderKey, headerValue(key))
	resp, err = decodeHTTPStep(dst.GetValue(), asSent)
	if err != nil {
		return nil, true, ErrStepChanged.with(fmt.Sprintf("step %q: %v", name, err), nil)
	}
	return resp, true, nil
}

// errUnrecorded is how httpStep's send leaves a response unrecorded.
var errUnrecorded = errors.New("idempotency: not recorded")

// recordedStatus reports whether a response with status is recorded: not
// one another attempt of the same request may change, nor a redirect,
// whose request the client makes next.
func recordedStatus(status int) bool {
	switch status {
	case http.StatusRequestTimeout, http.StatusConflict, http.StatusTooEarly, http.StatusTooManyRequests:
		return false
	}
	return status < 300 || (status >= 400 && status < 500)
}

// httpStepMark is field 15 of a recorded HTTP response, which tells it
// from any other bytes a step of the same name recorded.
const httpStepMark = "idempotency http response v1"

// encodeHTTPStep encodes resp and its body for a step's record: field 1
// the status, field 2 each header (as the HTTP middleware stores them),
// field 4 the body, field 15 httpStepMark.
func encodeHTTPStep(resp *http.Response, body []byte) []byte {
	b := protowire.AppendString(protowire.AppendTag(nil, 15, protowire.BytesType), httpStepMark)
	b = protowire.AppendVarint(protowire.AppendTag(b, 1, protowire.VarintType), uint64(resp.StatusCode))
	for _, name := range slices.Sorted(maps.Keys(resp.Header)) {
		b = appendEntry(b, 2, name, resp.Header[name])
	}
	return protowire.AppendBytes(protowire.AppendTag(b, 4, protowire.BytesType), body)
}

// decodeHTTPStep rebuilds a recorded response, as the answer to req.
func decodeHTTPStep(b []byte, req *http.Request) (*http.Response, error) {
	resp := &http.Response{Proto: "HTTP/1.1", ProtoMajor: 1, ProtoMinor: 1, Header: http.Header{}, Request: req}
	var body []byte
	marked := false
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return nil, errors.New("the recorded HTTP response is malformed")
		}
		b = b[n:]
		switch {
		case num == 1 && typ == protowire.VarintType:
			v, n := protowire.ConsumeVarint(b)
			if n < 0 || v < 100 || v > 999 {
				return nil, errors.New("the recorded HTTP status is malformed")
			}
			resp.StatusCode, b = int(v), b[n:]
		case (num == 2 || num == 4 || num == 15) && typ == protowire.BytesType:
			v, n := protowire.ConsumeBytes(b)
			if n < 0 {
				return nil, errors.New("the recorded HTTP response is malformed")
			}
			b = b[n:]
			switch num {
			case 2:
				name, values, err := decodeEntry(v)
				if err != nil {
					return nil, err
				}
				resp.Header[name] = values
			case 4:
				body = v
			case 15:
				marked = string(v) == httpStepMark
			}
		default:
			return nil, errors.New("the recorded HTTP response is malformed")
		}
	}
	if !marked || resp.StatusCode == 0 {
		return nil, errors.New("the record is not an HTTP response")
	}
	resp.Status = fmt.Sprintf("%d %s", resp.StatusCode, http.StatusText(resp.StatusCode))
	resp.Body, resp.ContentLength = io.NopCloser(bytes.NewReader(body)), int64(len(body))
	return resp, nil
}

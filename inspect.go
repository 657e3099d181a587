package idempotency

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net/http"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	statuspb "google.golang.org/genproto/googleapis/rpc/status"
	grpcstatus "google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// ErrKeyNotFound is returned by [Store.Inspect] and [Store.Forget] for a key
// that has no record (never used, released, or deleted by the cleaner).
var ErrKeyNotFound = errors.New("idempotency: no record of this key")

// Record is what a store keeps of one key, for operators: [Store.Inspect].
type Record struct {
	Scope, Key string
	// Transport is the kind of call the key belongs to: TransportHTTP,
	// TransportMessage, or TransportGRPC for gRPC calls and Store.Execute,
	// which share one namespace of keys.
	Transport Transport
	// Method is the operation the key was used for: the gRPC full method,
	// "POST /path" for HTTP, "idempotency/message" for a message.
	Method string
	// State is "succeeded" (Response holds the result) or "failed" (Status
	// holds the final error); "running" is a claim its handler committed
	// (it ended the call's transaction itself), which the next call with
	// the key stores as failed.
	State string
	// CreatedAt is when the key was claimed, CompletedAt when its result
	// was stored (zero for a claim, and for keys stored by earlier versions
	// of this module, whose CreatedAt is that moment), ExpiresAt when the
	// key expires; Expired says whether it already has (the cleaner has not
	// deleted it yet).
	CreatedAt, CompletedAt, ExpiresAt time.Time
	Expired                           bool
	// ResponseType is the stored response's protobuf message name, "" when
	// there is none; Response its encoding. An HTTP response is a
	// google.protobuf.BytesValue holding the body.
	ResponseType string
	Response     []byte
	// Status is the final error of a failed call.
	Status *grpcstatus.Status
	// Fingerprint identifies the request the key was first used with.
	Fingerprint []byte
	// Metadata is what the transport stored with the result (a gRPC call's
	// headers and trailers, an HTTP response's status, headers and
	// trailers), in its
	// own encoding.
	Metadata []byte
}

// HTTPResponse returns the response an HTTP request's record holds: its
// status, the headers a replay of it can send, and its body. Set-Cookie,
// Authorization and the other headers no replay ever sends are left out,
// though the middleware's first version stored them; of the others a
// record of that version holds (Date, say), a replay sends only those its
// middleware's WithHTTPReplayedHeaders allows. ok is false for a record of
// another transport, or one without a response (an error the engine
// stored, such as a handler that ended the transaction; Status has it).
func (r Record) HTTPResponse() (status int, header http.Header, body []byte, ok bool) {
	rr := r.httpResponse()
	if rr == nil {
		return 0, nil, nil, false
	}
	return rr.statusCode(), rr.sent, rr.body.Bytes(), true
}

// HTTPTrailer returns the trailers stored with an HTTP request's response
// that a replay can send (as HTTPResponse's headers), nil when there are
// none or the record is not an HTTP response.
func (r Record) HTTPTrailer() http.Header {
	if rr := r.httpResponse(); rr != nil && len(rr.trailer) > 0 {
		return rr.trailer
	}
	return nil
}

// httpResponse decodes the HTTP response the record holds, nil for none,
// without the headers and trailers no replay sends.
func (r Record) httpResponse() *responseRecorder {
	if r.Transport != TransportHTTP || r.ResponseType != string(httpBodyType.Descriptor().FullName()) {
		return nil
	}
	m := &wrapperspb.BytesValue{}
	if err := proto.Unmarshal(r.Response, m); err != nil {
		return nil
	}
	rr, err := decodeHTTPResponse(result{Result: Result{Response: m}, metadata: r.Metadata})
	if err != nil {
		return nil
	}
	for _, h := range []http.Header{rr.sent, rr.trailer} {
		maps.DeleteFunc(h, func(name string, _ []string) bool { return !replayable(name) })
	}
	return rr
}

// namespaces are the transports' namespaces of stored keys, in the order
// Inspect and Forget look in them.
var namespaces = []struct {
	prefix    string
	transport Transport
}{{"", TransportGRPC}, {namespaceHTTP, TransportHTTP}, {namespaceMessage, TransportMessage}}

// storedKeys returns the stored keys key may name: key as each transport
// stores it, in the order of namespaces; or key alone when it is one
// already ("http KEY", "message KEY": no client's key has a space).
func storedKeys(key string) []string {
	for _, ns := range namespaces[1:] {
		if strings.HasPrefix(key, ns.prefix) {
			return []string{key}
		}
	}
	keys := make([]string, len(namespaces))
	for i, ns := range namespaces {
		keys[i] = ns.prefix + key
	}
	return keys
}

// transportOf splits a stored key into its transport and the key.
func transportOf(stored string) (Transport, string) {
	for _, ns := range namespaces[1:] {
		if key, ok := strings.CutPrefix(stored, ns.prefix); ok {
			return ns.transport, key
		}
	}
	return TransportGRPC, stored
}

// Inspect returns the record of one key. Keys of different transports
// never collide in the table; a key used by more than one (an HTTP
// request's and a gRPC call's, say) is looked for among gRPC calls and
// Execute's first, then HTTP requests, then messages. To name one
// transport's, prefix the key with its namespace: "http KEY" or
// "message KEY". A key whose call is still running has no record yet:
// Inspect then returns [ErrInProgress]; one with no record and no call,
// [ErrKeyNotFound].
func (s *Store) Inspect(ctx context.Context, scope, key string) (Record, error) {
	rec := Record{Scope: scope, Key: key}
	st, err := s.statements(ctx)
	if err != nil {
		return rec, s.dbError(ctx, "inspect key", err)
	}
	keys := storedKeys(key)
	var stored string
	var responseType, response, status, fingerprint, metadata *string
	var created, expires int64
	var completed *int64
	err = s.readCommitted(ctx, func(tx pgx.Tx) error {
		err := tx.QueryRow(ctx, st.inspect, scope, keys).Scan(&stored, &rec.Method, &rec.State, &created, &completed, &expires, &rec.Expired,
			&responseType, &response, &status, &fingerprint, &metadata)
		if !errors.Is(err, pgx.ErrNoRows) {
			return err
		}
		var free bool
		if err := tx.QueryRow(ctx, st.lockForget, scope, keys).Scan(&free); err != nil {
			return err
		}
		if !free {
			return inProgress("the key's call is still running; nothing is stored for it yet", s.opts.retryDelay)
		}
		return ErrKeyNotFound
	})
	if errors.Is(err, ErrKeyNotFound) || errors.Is(err, ErrInProgress) {
		return rec, err
	}
	if err != nil {
		return rec, s.dbError(ctx, "inspect key", err)
	}
	rec.CreatedAt, rec.ExpiresAt = time.UnixMicro(created), time.UnixMicro(expires)
	if completed != nil {
		rec.CompletedAt = time.UnixMicro(*completed)
	}
	var statusBytes []byte
	for _, c := range []struct {
		dst *[]byte
		src *string
	}{{&rec.Response, response}, {&statusBytes, status}, {&rec.Fingerprint, fingerprint}, {&rec.Metadata, metadata}} {
		if *c.dst, err = decodeBase64(c.src); err != nil {
			return rec, fmt.Errorf("idempotency: inspect key: %w", err)
		}
	}
	rec.Transport, rec.Key = transportOf(stored)
	if responseType != nil {
		rec.ResponseType = *responseType
	}
	if statusBytes != nil {
		p := &statuspb.Status{}
		if err := proto.Unmarshal(statusBytes, p); err != nil {
			return rec, fmt.Errorf("idempotency: inspect key: stored status: %w", err)
		}
		rec.Status = grpcstatus.FromProto(p)
	}
	return rec, nil
}

// Forget deletes the record of one key, so that the next call with it runs
// again: for an operator who knows the stored result must not be replayed
// (a customer's charge that was refunded by hand, say). It deletes the
// record Inspect shows (name a transport's key with its namespace, as for
// Inspect). It refuses, with [ErrInProgress], while a call holds the key
// (in any of the transports it may name), and returns [ErrKeyNotFound]
// when there is no record.
func (s *Store) Forget(ctx context.Context, scope, key string) error {
	return s.forget(ctx, scope, key, false)
}

// ErrNotFailed is returned by [Store.ForgetFailed] for a key whose record
// is not a failure: its call succeeded (or its handler committed its own
// transaction), and its effect must not be applied again.
var ErrNotFailed = errors.New("idempotency: the key's call did not fail; its record is kept")

// ForgetFailed is Forget for a record whose call failed for good (State
// "failed": a Final error, a message given up): it deletes it, so that the
// next call with the key runs again once its cause is fixed. A record of a
// call that succeeded is kept ([ErrNotFailed]), in the same statement that
// would delete it: a redrive repeated, or racing the call it redrives,
// never forgets an effect that was applied.
func (s *Store) ForgetFailed(ctx context.Context, scope, key string) error {
	return s.forget(ctx, scope, key, true)
}

func (s *Store) forget(ctx context.Context, scope, key string, onlyFailed bool) error {
	st, err := s.statements(ctx)
	if err != nil {
		return s.dbError(ctx, "forget key", err)
	}
	keys := storedKeys(key)
	err = s.readCommitted(ctx, func(tx pgx.Tx) error {
		var free bool
		if err := tx.QueryRow(ctx, st.lockForget, scope, keys).Scan(&free); err != nil {
			return err
		}
		if !free {
			return inProgress("a call holds the key; forget it once the call is over", s.opts.retryDelay)
		}
		if onlyFailed {
			var state string
			switch err := tx.QueryRow(ctx, st.forgetFailed, scope, keys).Scan(&state); {
			case errors.Is(err, pgx.ErrNoRows):
				return ErrKeyNotFound
			case err != nil:
				return err
			case state != "failed":
				return fmt.Errorf("%w (state %s)", ErrNotFailed, state)
			}
			return nil
		}
		tag, err := tx.Exec(ctx, st.forget, scope, keys)
		if err == nil && tag.RowsAffected() == 0 {
			err = ErrKeyNotFound
		}
		return err
	})
	if err != nil && !errors.Is(err, ErrKeyNotFound) && !errors.Is(err, ErrInProgress) && !errors.Is(err, ErrNotFailed) {
		err = s.dbError(ctx, "forget key", err)
	}
	return err
}

// readCommitted runs fn in a READ COMMITTED transaction of its own, so that
// the engine's reads of the key table never count in SERIALIZABLE's
// conflict tracking, whatever the database's default. fn's error rolls it
// back.
func (s *Store) readCommitted(ctx context.Context, fn func(tx pgx.Tx) error) error {
	pc, err := s.db.Acquire(ctx)
	if err != nil {
		return err
	}
	defer pc.Release()
	return pgx.BeginTxFunc(ctx, pc.Conn(), pgx.TxOptions{IsoLevel: pgx.ReadCommitted}, fn)
}

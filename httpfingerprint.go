package idempotency

import (
	"bytes"
	"crypto/sha256"
	"errors"
	"io"
	"maps"
	"mime"
	"mime/multipart"
	"net/http"
	"net/url"
	"slices"
	"strings"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Version 6 of the fingerprint format (see fingerprint.go) identifies an
// HTTP request:
//
//	request    32 bytes: SHA-256 of the method, the target and the host the
//	           client sent (lower case), and the Content-Type as RFC 9110
//	           reads it (its media type and parameters but a multipart
//	           boundary, as mime.FormatMediaType writes them, with a
//	           charset's name in lower case), each length-prefixed
//	flags      1 byte: 1 the form's digest follows, 2 the body's, 4 (with
//	           2) the body's digest is of its canonical JSON, 8 the
//	           request's digest as version 5 had it follows
//	form       32 bytes: SHA-256 of the form's fields (url.Values.Encode:
//	           names sorted, values in order) and, for a multipart form,
//	           each file in field order: field, name, type, SHA-256 of the
//	           content
//	body       32 bytes: SHA-256 of the body's bytes; with flag 4, of its
//	           canonical JSON (see jsonDigest)
//	bytes      with flag 4 only, 32 bytes: SHA-256 of the body's bytes, as
//	           version 4 had it, to compare with a row of that release
//	request5   with flag 8 only, 32 bytes: the request's digest as version
//	           5 had it (a charset's value as spelled), when it differs, to
//	           compare with a row of that release
//
// Flag 16 (with 1 and 2) says that the form is a multipart body the
// middleware read and parsed: version 5 gave such a body the digest of a
// form that does not parse, and version 2 of the derivation derives from
// that (see previous). The comparison ignores it.
//
// A body has a form digest when net/http would parse it as a form (its
// Content-Type, read as ParseForm reads it; a multipart body that does not
// parse has the digest of one that does not, and so had every multipart
// body the middleware read before version 6; one past ReadForm's limits on
// parts and headers, the digest of that), and a body digest when its
// bytes were there to read: a middleware in front that parsed the form
// (r.ParseForm, r.PostFormValue, r.ParseMultipartForm; CSRF middleware
// does, on some requests and not on others) consumed them. A body whose
// media type is JSON (isJSONType) and that is one JSON value is digested
// as its canonical JSON, so that whitespace, the order of an object's keys
// and the escaping of a string do not count; any other body, and a JSON
// one that does not parse, by its bytes. Two requests are the same when
// their requests agree, their forms when either has one (one form for
// both, parsed in front or not), and their bodies when both have a body
// digest (of one kind: under one Content-Type, a body that parses as JSON
// is never the same as one that does not). So a form is the same request
// parsed in front or not, while two bodies the handler could read
// differently (JSON sent as a form, "a+b" and "a b") are never one.
//
// The keys a request derives for downstream calls follow the comparison
// (see httpParts.identity): they hash its request and its form, or
// without a form its body's digest, never the bytes of a body compared by
// value. Two requests the comparison calls the same derive the same keys;
// two it tells apart derive different ones, but two bodies of one form
// (the same form sent as "a+b" and as "a%20b"), which are each the same
// request as that form parsed in front.
//
// Version 5, the release before, is version 6 with the Content-Type's
// parameters as spelled but for their names, and without flag 8; version
// 4, the one before, is version 5 without flag 4 (and without the bytes'
// digest): a JSON body was digested by its bytes. A row of either is
// compared with a version 6 fingerprint as its release compared two (by
// request5 or the request, see sameHTTP); one that does not parse as its
// version is the same request as nothing (malformedHTTP).
const (
	httpVersion    = 6
	httpVersion5   = 5 // read only, to compare with a row of that release
	httpVersion4   = 4 // likewise
	httpHeadLen    = len(fingerprintMagic) + 1 + sha256.Size + 1
	httpHasForm    = 1
	httpHasBody    = 2
	httpJSONBody   = 4
	httpRequest5   = 8
	httpMultipart  = 16
	httpFlagsMask  = httpHasForm | httpHasBody | httpJSONBody | httpRequest5 | httpMultipart
	httpFlagsMask5 = httpHasForm | httpHasBody | httpJSONBody
	httpFlagsMask4 = httpHasForm | httpHasBody
)

// httpFingerprint returns the fingerprint of r, whose target is as the
// client sent it and body what was left to read of it. A form parsed in
// front is held to the body's limit too (413), so that a request gets one
// answer whether or not something in front parsed it: by the length the
// client declared (readBody refused one over the limit), or without one by
// the size of its fields and files, which is what an unparsed form sent
// without a length is held to as well.
func httpFingerprint(r *http.Request, target string, body []byte, limit int64) ([]byte, int, error) {
	ct := r.Header.Get("Content-Type")
	if ct == "" {
		ct = "application/octet-stream" // as ParseForm
	}
	// As ParseForm reads the type: a malformed parameter does not keep it
	// from being a form's type.
	mediaType, params, typeErr := mime.ParseMediaType(ct)
	spelled, read := contentType(ct, mediaType, params, typeErr)
	request := func(contentType string) []byte {
		h := sha256.New()
		writeParts(h, []byte(r.Method), []byte(target), []byte(strings.ToLower(r.Host)), []byte(contentType))
		return h.Sum(nil)
	}
	out := append([]byte(fingerprintMagic), httpVersion)
	out = append(out, request(read)...)
	flags := len(out)
	out = append(out, 0)

	isForm := mediaType == "application/x-www-form-urlencoded" || mediaType == "multipart/form-data"
	// Consumed: a middleware in front parsed the form, reading the body.
	// (ParseForm leaves any other body unread.)
	consumed := len(body) == 0 && (r.MultipartForm != nil || (r.PostForm != nil && isForm))
	var form *formSum
	if consumed || isForm {
		var err error
		if form, err = formDigest(r, body, consumed, mediaType, params, typeErr); err != nil {
			return nil, http.StatusInternalServerError, err
		}
	}
	if form != nil && r.ContentLength < 0 && form.size > limit {
		return nil, http.StatusRequestEntityTooLarge, errTooLarge(limit)
	}
	if form != nil {
		out[flags] |= httpHasForm
		out = append(out, form.sum[:]...)
		if !consumed && mediaType == "multipart/form-data" {
			out[flags] |= httpMultipart
		}
	}
	if !consumed {
		out[flags] |= httpHasBody
		sum, canonical := bodyDigest(mediaType, params, typeErr, body)
		out = append(out, sum[:]...)
		if canonical {
			out[flags] |= httpJSONBody
			raw := sha256.Sum256(body)
			out = append(out, raw[:]...)
		}
	}
	if spelled != read {
		out[flags] |= httpRequest5
		out = append(out, request(spelled)...)
	}
	return out, 0, nil
}

// bodyDigest is the digest of a body read whole: of its canonical JSON when
// its media type is JSON in UTF-8 (no charset, which RFC 8259 makes UTF-8,
// or charset utf-8: the canonical form reads the bytes as UTF-8, and a
// handler that honours another charset would read them otherwise) and it
// is one JSON value (canonical), else of its bytes. A Content-Type whose
// parameters Go cannot parse (typeErr) may name a charset all the same
// (RFC 9110 reads "charset=iso-8859-1;;"), so its body is compared by its
// bytes.
func bodyDigest(mediaType string, params map[string]string, typeErr error, body []byte) (sum [sha256.Size]byte, canonical bool) {
	if cs, ok := params["charset"]; typeErr == nil && isJSONType(mediaType) && (!ok || strings.EqualFold(cs, "utf-8") || strings.EqualFold(cs, "utf8")) {
		if sum, ok := jsonDigest(body); ok {
			return sum, true
		}
	}
	return sha256.Sum256(body), false
}

// contentType is the request's Content-Type as it bears on the body's
// meaning: its media type and parameters, but for a multipart boundary,
// which changes with every encoding of the same form. read is it as RFC
// 9110 reads it: the media type and parameter names (which
// mime.ParseMediaType gives in lower case) and a charset's name are
// case-insensitive, a quoted value is its token; any other parameter's
// value counts as spelled, as its meaning may. spelled is it as version 5
// wrote it, with a charset's name as sent.
func contentType(raw, mediaType string, params map[string]string, err error) (spelled, read string) {
	if err == nil {
		// A copy: the form is parsed with the boundary.
		params = maps.Clone(params)
		delete(params, "boundary")
		if spelled = mime.FormatMediaType(mediaType, params); spelled != "" {
			if cs, ok := params["charset"]; ok {
				params["charset"] = strings.ToLower(cs)
			}
			return spelled, mime.FormatMediaType(mediaType, params)
		}
	}
	t := strings.ToLower(strings.TrimSpace(raw))
	return t, t
}

// errTooLarge is the error of a body over the limit.
func errTooLarge(limit int64) error {
	return status.Errorf(codes.InvalidArgument, "idempotency: the request body is over %d bytes, the most that can be fingerprinted", limit)
}

// readLimit is how much of the body the middleware reads: the limit, or
// for a form sent without a length, which is held to the limit by the size
// of its fields and files (see httpFingerprint), as much as net/http's
// ParseForm reads of one.
func readLimit(r *http.Request, limit int64) int64 {
	if r.ContentLength >= 0 {
		return limit
	}
	mediaType, _, _ := mime.ParseMediaType(r.Header.Get("Content-Type"))
	if mediaType == "application/x-www-form-urlencoded" || mediaType == "multipart/form-data" {
		return max(limit, maxFormBytes)
	}
	return limit
}

// maxFormBytes is what net/http's ParseForm reads of a form at most.
const maxFormBytes = 10 << 20

// formSum identifies a form: the digest of its fields and files, and
// their size.
type formSum struct {
	sum  [sha256.Size]byte
	size int64
}

// formDigest identifies the request's form: from what a middleware in
// front parsed (consumed), or from the body's bytes, parsed as net/http
// parses them. A multipart body that does not parse is identified as
// such, parsed in front or not (the handler sees no form either way).
func formDigest(r *http.Request, body []byte, consumed bool, mediaType string, params map[string]string, typeErr error) (*formSum, error) {
	switch {
	case consumed && r.MultipartForm != nil:
		return multipartDigest(r.MultipartForm)
	case mediaType == "application/x-www-form-urlencoded":
		fields := r.PostForm
		if !consumed {
			// What parsed before an invalid pair, as ParseForm keeps it.
			fields, _ = url.ParseQuery(string(body))
		}
		enc := fields.Encode()
		return &formSum{sha256.Sum256([]byte("form\x00" + enc)), int64(len(enc))}, nil
	case !consumed && typeErr == nil && params["boundary"] != "":
		// The files stay in memory: the body is within its limit.
		form, err := multipart.NewReader(bytes.NewReader(body), params["boundary"]).ReadForm(int64(len(body)) + 1)
		if err == nil {
			defer func() { _ = form.RemoveAll() }()
			return multipartDigest(form)
		}
		if errors.Is(err, multipart.ErrMessageTooLarge) {
			// More parts or headers than ReadForm reads: a handler that
			// reads it part by part (r.MultipartReader) reads it all, so
			// it is its bytes (see identity).
			return &formSum{multipartPastLimits, int64(len(body))}, nil
		}
	}
	f := unparsedMultipart()
	f.size = int64(len(body))
	return &f, nil
}

// unparsedMultipart is the digest of a multipart body that does not parse.
func unparsedMultipart() formSum {
	return formSum{sum: sha256.Sum256([]byte("multipart that does not parse"))}
}

// multipartPastLimits is the form digest of a multipart body that
// net/http's ReadForm refuses for its number of parts or headers: it is
// never one that something in front parsed, which failed on it before
// reading it whole.
var multipartPastLimits = sha256.Sum256([]byte("multipart past ReadForm's limits"))

// multipartDigest is the digest of a multipart form: its fields, then each
// file in field order, by field, name, type and content.
func multipartDigest(form *multipart.Form) (*formSum, error) {
	h := sha256.New()
	values := url.Values(form.Value).Encode()
	h.Write([]byte("multipart\x00" + values))
	size := int64(len(values))
	for _, field := range slices.Sorted(maps.Keys(form.File)) {
		for _, fh := range form.File[field] {
			f, err := fh.Open()
			if err != nil {
				return nil, status.Errorf(codes.Internal, "idempotency: reading the file %q of the parsed multipart form: %v", fh.Filename, err)
			}
			content := sha256.New()
			_, err = io.Copy(content, f)
			_ = f.Close()
			if err != nil {
				return nil, status.Errorf(codes.Internal, "idempotency: reading the file %q of the parsed multipart form: %v", fh.Filename, err)
			}
			size += fh.Size
			writeParts(h, []byte(field), []byte(fh.Filename), []byte(fh.Header.Get("Content-Type")), content.Sum(nil))
		}
	}
	f := &formSum{size: size}
	h.Sum(f.sum[:0])
	return f, nil
}

// malformedHTTP reports whether fp carries the tag of version 6, 5 or 4
// but not its form: a damaged row, which is the same request as nothing.
func malformedHTTP(fp []byte) bool {
	tag := len(fingerprintMagic) + 1
	if len(fp) < tag || string(fp[:len(fingerprintMagic)]) != fingerprintMagic {
		return false
	}
	switch fp[tag-1] {
	case httpVersion, httpVersion5, httpVersion4:
		_, ok := readHTTP(fp)
		return !ok
	}
	return false
}

// httpParts is a well-formed HTTP fingerprint of version 4, 5 or 6, read.
type httpParts struct {
	version byte
	flags   byte   // but httpRequest5
	request []byte // as its version writes it
	// request5 is the request as versions 5 and 4 wrote it: the Content-
	// Type's parameters as spelled.
	request5 []byte
	// form and body are the digests of the form and the body, nil when
	// absent; bytes is the digest of the body's bytes (body's, but for a
	// body digested as its canonical JSON).
	form, body, bytes []byte
}

// readHTTP reads fp as an HTTP fingerprint of version 4, 5 or 6, and
// false when it is not a well-formed one.
func readHTTP(fp []byte) (httpParts, bool) {
	if len(fp) < httpHeadLen || string(fp[:len(fingerprintMagic)]) != fingerprintMagic {
		return httpParts{}, false
	}
	p := httpParts{version: fp[len(fingerprintMagic)], request: fp[len(fingerprintMagic)+1 : httpHeadLen-1]}
	flags := fp[httpHeadLen-1]
	switch p.version {
	case httpVersion:
		if flags&^httpFlagsMask != 0 {
			return httpParts{}, false
		}
	case httpVersion5:
		if flags&^httpFlagsMask5 != 0 {
			return httpParts{}, false
		}
	case httpVersion4:
		if flags&^httpFlagsMask4 != 0 {
			return httpParts{}, false
		}
	default:
		return httpParts{}, false
	}
	if flags&httpJSONBody != 0 && flags&httpHasBody == 0 ||
		flags&httpMultipart != 0 && flags&(httpHasForm|httpHasBody) != httpHasForm|httpHasBody {
		return httpParts{}, false
	}
	p.flags = flags &^ httpRequest5
	rest := fp[httpHeadLen:]
	next := func() []byte {
		if len(rest) < sha256.Size {
			return nil
		}
		d := rest[:sha256.Size:sha256.Size]
		rest = rest[sha256.Size:]
		return d
	}
	ok := true
	take := func(flag byte) []byte {
		if flags&flag == 0 {
			return nil
		}
		d := next()
		ok = ok && d != nil
		return d
	}
	p.form = take(httpHasForm)
	p.body = take(httpHasBody)
	p.bytes = p.body
	if flags&httpJSONBody != 0 {
		p.bytes = take(httpJSONBody)
	}
	p.request5 = p.request
	if flags&httpRequest5 != 0 {
		p.request5 = take(httpRequest5)
	}
	return p, ok && len(rest) == 0
}

// sameHTTP compares two HTTP fingerprints (see above). Two of version 6
// compare their requests as RFC 9110 reads a Content-Type; a row of
// version 5 or 4 is compared as its release compared two: by its request
// as spelled, and a row of version 4 by the bytes of the body, a JSON one
// too, when both have a body, else by the form.
func sameHTTP(a, b httpParts) bool {
	if a.version == httpVersion && b.version == httpVersion {
		return bytes.Equal(a.request, b.request) && sameContent(a, b)
	}
	if !bytes.Equal(a.request5, b.request5) {
		return false
	}
	switch {
	case a.version == httpVersion4 || b.version == httpVersion4:
		if a.bytes != nil && b.bytes != nil {
			return bytes.Equal(a.bytes, b.bytes)
		}
	case a.body != nil && b.body != nil:
		// A digest of canonical JSON is never one of bytes.
		return (a.flags^b.flags)&httpJSONBody == 0 && bytes.Equal(a.body, b.body)
	}
	// Those releases gave a multipart body the middleware parsed the form
	// digest of one that does not parse: compared by its bytes, or, parsed
	// in front on one side, another form.
	return a.form != nil && b.form != nil && bytes.Equal(a.form, b.form)
}

// sameContent compares the forms and bodies of two requests whose
// requests agree: the forms when either has one, and the bodies, of one
// kind, when both have one. So every pair it calls the same has one
// identity (see identity).
func sameContent(a, b httpParts) bool {
	if (a.form != nil || b.form != nil) && !bytes.Equal(a.form, b.form) {
		return false
	}
	if a.body != nil && b.body != nil {
		// A digest of canonical JSON is never one of bytes.
		return (a.flags^b.flags)&httpJSONBody == 0 && bytes.Equal(a.body, b.body)
	}
	return a.form != nil // else one of them consumed what is no form
}

// identity is what the keys a request derives for downstream calls know
// of it (see derivationInput): its request and its form, or without a form
// (or with a multipart body past ReadForm's limits, which only a handler
// reading it part by part reads) its body's digest and kind, which every
// request that sameContent calls the same as it holds alike. The bytes of
// a body that has another form, or that is compared as JSON, are left
// out: a request parsed in front has no bytes, and JSON written another
// way other ones.
//
// It is written as version 5 wrote a fingerprint with those parts alone,
// so that a request whose version 5 fingerprint held nothing else (a body
// compared by its bytes, a form parsed in front) keeps the keys the
// release before derived from its whole fingerprint, unless its charset's
// name was spelled in upper case.
func (p httpParts) identity() []byte {
	out := make([]byte, 0, httpHeadLen+sha256.Size)
	out = append(append(out, fingerprintMagic...), httpVersion5)
	out = append(out, p.request...)
	if p.form != nil && (p.body == nil || !bytes.Equal(p.form, multipartPastLimits[:])) {
		return append(append(out, httpHasForm), p.form...)
	}
	return append(append(out, p.flags&(httpHasBody|httpJSONBody)), p.body...)
}

// previous is the fingerprint version 5 stored for the request p, from
// which the release before derived its keys (WithDerivedKeyVersion(2)):
// a multipart body the middleware read had the digest of a form that does
// not parse there (that release dropped the boundary before it parsed the
// body).
func (p httpParts) previous() []byte {
	out := make([]byte, 0, httpHeadLen+3*sha256.Size)
	out = append(append(out, fingerprintMagic...), httpVersion5)
	out = append(append(out, p.request5...), p.flags&httpFlagsMask5)
	form := p.form
	if p.flags&httpMultipart != 0 {
		sum := unparsedMultipart()
		form = sum.sum[:]
	}
	for _, d := range [][]byte{form, p.body} {
		out = append(out, d...)
	}
	if p.flags&httpJSONBody != 0 {
		out = append(out, p.bytes...)
	}
	return out
}

// derivationInput is what the keys of a call derive from of its
// fingerprint, when its transport gave no digest of its request (see
// downstream.baseLocked): an HTTP request's identity (under version 2 of
// the derivation, its whole fingerprint as the release before stored it),
// or the fingerprint whole, which the comparison compares byte for byte (a
// message's body, a caller's own bytes).
func derivationInput(fp []byte, version int) []byte {
	p, ok := readHTTP(fp)
	switch {
	case !ok:
		return fp
	case version < 3:
		return p.previous()
	}
	return p.identity()
}
